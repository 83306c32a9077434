"""
The emulated execution point: a ``condor_master`` with one startd, in one process

It behaves like an HTCondor EP in the ways the drone agent depends on:

* the startd has ``NUM_CPUS`` static slots, or one partitionable slot if
  ``SLOT_TYPE_1_PARTITIONABLE`` is true (dynamic slots ``slot1_N`` per job);
* an offered job is claimed only if ``START`` (from the configuration, with
  the ``condor_update_machine_ad`` extras merged into the slot ad) is true and
  the startd is not draining; otherwise it stays idle in the overlay pool;
* a claimed job first runs the configured ``<KEYWORD>_HOOK_PREPARE_JOB`` (the
  job ad on stdin, the master's environment, no timeout) and honours its
  result as the starter does: ``HookStatusCode`` >= 300 or death by a signal
  sends the job back to idle, 1-299 or a plain non-zero exit holds it, 0 runs it;
* the payload is a sleep of the offered duration; then ``<KEYWORD>_HOOK_JOB_EXIT``
  runs with the reason (``exit`` or ``evict``) and ``<KEYWORD>_HOOK_JOB_EXIT_TIMEOUT``;
* ``condor_drain``: graceful (payloads retire within ``MaxJobRetirementTime``),
  quick and fast (payloads are killed), ``-check``, ``-start``, ``-cancel``,
  ``-exit-on-completion``/``-resume-on-completion``; a second drain is refused
  with error 10001;
* when the startd has exited, the master evaluates ``MASTER.DAEMON_SHUTDOWN``
  every ``MASTER_UPDATE_INTERVAL`` seconds against ``STARTD_StartTime = 0`` and
  exits with 99 when it is true, as HTCondor does;
* SIGTERM (and SIGINT) shut down gracefully (retirement capped by
  ``SHUTDOWN_GRACEFUL_TIMEOUT``), SIGQUIT fast; the master then exits 0.

Everything that happens is written to the ground truth (``groundtruth.py``).
The fake tools and the tests talk to it through the control socket
(``control.py``, ``..rpc``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import signal
import time
from pathlib import Path
from typing import Any

from broker.emulation.execution_point.classad import (
    ERROR,
    UNDEFINED,
    Ad,
    ClassAdSyntaxError,
    Node,
    evaluate,
    literal,
)
from broker.emulation.execution_point.config import Config
from broker.emulation.execution_point.paths import (
    GROUND_TRUTH_FILE,
    MASTER_EXIT_FILE,
    control_socket_path,
)
from broker.emulation.groundtruth import GroundTruth
from broker.emulation.rpc import serve
from remote_agent.spool import private_directory

log = logging.getLogger("emulation.startd")

#: condor_drain's how-fast values and completion actions (``DrainType``, ``CompletionType``)
DRAIN_HOW = ("graceful", "quick", "fast")
COMPLETION = ("nothing", "resume", "exit", "restart", "reconfig")
#: startd refusals (``condor_error_codes.h``)
DRAINING_ALREADY_IN_PROGRESS = 10001
DRAINING_NO_MATCHING_REQUEST_ID = 10002
DRAINING_CHECK_EXPR_FAILED = 10003
#: ``MAX_REQUEST`` of the control socket, in bytes
MAX_CONTROL_REQUEST = 1 << 20

_STATUS_CODE_RE = re.compile(r"^\s*HookStatusCode\s*=\s*(-?\d+)\s*$", re.I | re.M)
_STATUS_MESSAGE_RE = re.compile(r'^\s*HookStatusMessage\s*=\s*"((?:[^"\\]|\\.)*)"\s*$', re.I | re.M)


@dataclasses.dataclass
class Settings:
    """The knobs the emulator reads from its HTCondor configuration"""

    state_dir: Path
    host: str
    startd_name: str
    cpus: int
    partitionable: bool
    start_expr: str
    retirement_expr: str
    shutdown_graceful_timeout_s: float
    master_update_s: float
    daemon_shutdown: str | None
    startd_start_delay_s: float
    prepare_job: list[str] | None
    job_exit: list[str] | None
    job_exit_timeout_s: float

    @classmethod
    def from_config(cls, config: Config) -> Settings:
        state_dir = Path(config.get("EMULATOR_STATE_DIR") or config.get("LOCAL_DIR") or ".")
        host = config.get("FULL_HOSTNAME") or "emulated.localdomain"
        name = config.get("STARTD_NAME", subsystem="STARTD")
        keyword = config.get("STARTER_JOB_HOOK_KEYWORD")
        prepare = job_exit = None
        if keyword:
            path = config.get(f"{keyword}_HOOK_PREPARE_JOB")
            if path:
                prepare = [
                    path,
                    *shlex.split(config.get(f"{keyword}_HOOK_PREPARE_JOB_ARGS", "") or ""),
                ]
            exit_path = config.get(f"{keyword}_HOOK_JOB_EXIT")
            job_exit = [exit_path] if exit_path else None
        return cls(
            state_dir=state_dir,
            host=host,
            startd_name=f"{name}@{host}" if name else host,
            cpus=max(1, config.get_int("NUM_CPUS", 1)),
            partitionable=config.get_bool("SLOT_TYPE_1_PARTITIONABLE", False),
            start_expr=config.get("START", subsystem="STARTD") or "True",
            retirement_expr=config.get("MAXJOBRETIREMENTTIME", subsystem="STARTD") or "0",
            shutdown_graceful_timeout_s=config.get_float("SHUTDOWN_GRACEFUL_TIMEOUT", 1800.0),
            master_update_s=config.get_float("MASTER_UPDATE_INTERVAL", 300.0),
            daemon_shutdown=config.get("DAEMON_SHUTDOWN", subsystem="MASTER"),
            startd_start_delay_s=config.get_float("EMULATOR_STARTD_START_DELAY", 0.2),
            prepare_job=prepare,
            job_exit=job_exit,
            job_exit_timeout_s=config.get_float(f"{keyword}_HOOK_JOB_EXIT_TIMEOUT", 30.0)
            if keyword
            else 30.0,
        )


@dataclasses.dataclass(eq=False)
class Job:
    """One offered job from the moment a slot is claimed for it"""

    job_id: str
    owner: str
    duration_s: float
    exit_code: int
    slot: Slot
    claimed_at: float
    number: int
    phase: str = "prepare"  #: prepare, running, exit_hook, done
    started_at: float | None = None
    started_mono: float | None = None  #: for run times, immune to clock steps
    kill_reason: str | None = None
    sleeper: asyncio.Task[None] | None = None
    hook: asyncio.subprocess.Process | None = None
    retire_timer: asyncio.TimerHandle | None = None

    @property
    def cluster_proc(self) -> tuple[int, int]:
        cluster, _, proc = self.job_id.partition(".")
        try:
            return int(cluster), int(proc or 0)
        except ValueError:
            return self.number, 0


@dataclasses.dataclass(eq=False)
class Slot:
    name: str
    slot_id: int
    kind: str  #: Static, Partitionable, Dynamic
    cpus: int
    state: str = "Unclaimed"
    activity: str = "Idle"
    entered: float = dataclasses.field(default_factory=time.time)
    job: Job | None = None
    next_dynamic: int = 1

    def enter(self, state: str, activity: str) -> None:
        if (state, activity) != (self.state, self.activity):
            self.state, self.activity, self.entered = state, activity, time.time()


@dataclasses.dataclass
class Drain:
    request_id: str
    how: str
    on_completion: str
    reason: str
    start_expr: str | None
    started_at: float


class EmulatedStartd:
    """The master and its startd; :meth:`run` until the master would exit"""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.truth = GroundTruth(settings.state_dir / GROUND_TRUTH_FILE)
        self.control_path = control_socket_path(settings.state_dir)
        self.pid = os.getpid()
        self.master_started = time.time()
        self.startd_running = False
        self.startd_ready = False
        self.startd_held = False  #: exited on drain completion; the master does not restart it
        self.startd_generation = 0
        self.startd_start_time = 0.0
        self.extras = Ad()
        self.slots: list[Slot] = []
        self.drain: Drain | None = None
        self.drain_requests = 0
        self.shutting_down: str | None = None
        self.jobs = 0
        self._exit: asyncio.Future[tuple[int, str]] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._no_jobs = asyncio.Event()  #: set whenever a job leaves its slot

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until the master exits; its exit code"""
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        self.truth.record("master_started", pid=self.pid, startd=self.settings.startd_name)
        with contextlib.suppress(FileNotFoundError):
            (self.settings.state_dir / MASTER_EXIT_FILE).unlink()
        for sig, how in (
            (signal.SIGTERM, "graceful"),
            (signal.SIGINT, "graceful"),
            (signal.SIGQUIT, "fast"),
        ):
            loop.add_signal_handler(sig, self._on_signal, sig, how)
        loop.add_signal_handler(signal.SIGHUP, lambda: None)  # condor_reconfig: nothing to do
        private_directory(self.control_path.parent)
        server = await serve(self.control_path, self.handle, limit=MAX_CONTROL_REQUEST)
        self._spawn(self._start_startd())
        self._spawn(self._master_updates())
        try:
            code, why = await self._exit
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                self.control_path.unlink()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.truth.record("master_exiting", exit_code=code, why=why)
        (self.settings.state_dir / MASTER_EXIT_FILE).write_text(
            json.dumps({"pid": self.pid, "exit_code": code, "why": why})
        )
        self.truth.close()
        return code

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _finish(self, code: int, why: str) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.set_result((code, why))

    def _on_signal(self, sig: signal.Signals, how: str) -> None:
        self.truth.record("signal", signal=sig.name, how=how)
        if self.shutting_down == "fast" or (self.shutting_down and how == "graceful"):
            return
        self.shutting_down = how
        self._spawn(self._shutdown(how))

    async def _start_startd(self) -> None:
        await asyncio.sleep(self.settings.startd_start_delay_s)
        if self.shutting_down:
            return
        self.startd_generation += 1
        self.startd_running, self.startd_held = True, False
        self.startd_start_time = time.time()
        self.extras = Ad()  # the machine ad extras do not survive a startd restart
        self.drain = None
        self._make_slots()
        self.startd_ready = True
        self.truth.record("startd_ready", startd_pid=self.startd_pid)

    def _make_slots(self) -> None:
        name = self.settings.startd_name
        if self.settings.partitionable:
            self.slots = [Slot(f"slot1@{name}", 1, "Partitionable", self.settings.cpus)]
        else:
            self.slots = [
                Slot(f"slot{i}@{name}", i, "Static", 1) for i in range(1, self.settings.cpus + 1)
            ]

    def _stop_startd(self, why: str, *, held: bool) -> None:
        self.startd_running = self.startd_ready = False
        self.startd_held = held
        self.startd_start_time = 0.0
        self.slots = []
        self.truth.record("startd_exited", why=why)

    async def _master_updates(self) -> None:
        """DAEMON_SHUTDOWN is evaluated when the master publishes its ad"""
        while True:
            await asyncio.sleep(self.settings.master_update_s)
            expr = self.settings.daemon_shutdown
            # before the startd ever started, STARTD_StartTime is 0 too: not a shutdown
            if not expr or self.startd_running or self.startd_generation == 0:
                continue
            master_ad = {
                "STARTD_StartTime": literal(int(self.startd_start_time)),
                "MyType": literal("DaemonMaster"),
                "Name": literal(self.settings.startd_name),
            }
            if evaluate(expr, master_ad) is True:
                self._finish(99, "MASTER.DAEMON_SHUTDOWN")
                return

    async def _shutdown(self, how: str) -> None:
        now = time.time()
        for slot in self.slots:
            job = slot.job
            if job is None:
                continue
            if how == "fast":
                self._kill(job, "shutdown_fast")
            else:
                retire = self._retirement_s(job)
                limit = min(
                    job.claimed_at + retire, now + self.settings.shutdown_graceful_timeout_s
                )
                self._schedule_kill(job, max(0.0, limit - now), "shutdown_graceful_timeout")
        while any(slot.job for slot in self.slots):
            self._no_jobs.clear()
            await self._no_jobs.wait()
        if self.startd_running:
            self._stop_startd(f"shutdown {how}", held=False)
        self._finish(0, f"SIGTERM/SIGQUIT ({how} shutdown)")

    # ------------------------------------------------------------------ ads

    @property
    def startd_pid(self) -> int:
        return self.pid + self.startd_generation if self.startd_running else 0

    @property
    def startd_address(self) -> str:
        port = 9618
        return (
            f"<127.0.0.1:{port}?addrs=127.0.0.1-{port}&alias={self.settings.host}"
            f"&noUDP&sock=startd_{self.pid}_{self.startd_generation:04x}>"
        )

    @property
    def master_address(self) -> str:
        return (
            f"<127.0.0.1:9618?addrs=127.0.0.1-9618&alias={self.settings.host}"
            f"&noUDP&sock=master_{self.pid}_0001>"
        )

    def ready_ad(self) -> Ad:
        """The master's answer to DC_QUERY_READY (``Daemons::InitDaemonReadyAd``)"""
        ad = Ad()
        ad.set("MASTER", "Alive")
        ad.set("MASTER_PID", self.pid)
        ad.set("MASTER_Addr", self.master_address)
        if self.startd_running:
            ad.set("STARTD", "Alive")
            ad.set("STARTD_PID", self.startd_pid)
            ad.set("STARTD_Addr", self.startd_address)
            if self.startd_ready:
                ad.set("STARTD_State", "Ready")
        else:
            ad.set("STARTD", "Hold" if self.startd_held else "Startup")
            ad.set("STARTD_PID", 0)
        alive = 1 + int(self.startd_running)
        ad.set("NumDaemons", 2)
        ad.set("NumAlive", alive)
        ad.set("NumStartup", int(not self.startd_running and not self.startd_held))
        ad.set("NumHung", 0)
        ad.set("NumHold", int(self.startd_held))
        ad.set("NumDead", 0)
        ad.set("IsReady", self.startd_running or self.startd_held)
        if self.shutting_down:
            ad.set("InShutdownMode", "Exit")
        return ad

    def slot_ad(self, slot: Slot) -> Ad:
        ad = Ad()
        ad.set("MyType", "Machine")
        ad.set("Name", slot.name)
        ad.set("Machine", self.settings.host)
        ad.set("MyAddress", self.startd_address)
        ad.set("SlotID", slot.slot_id)
        ad.set("SlotType", slot.kind)
        ad.set("PartitionableSlot", slot.kind == "Partitionable")
        if slot.kind == "Dynamic":
            ad.set("DynamicSlot", True)
        ad.set("Cpus", slot.cpus)
        ad.set("Memory", 2048 * slot.cpus)
        ad.set("State", slot.state)
        ad.set("Activity", slot.activity)
        ad.set("EnteredCurrentState", int(slot.entered))
        ad.set("EnteredCurrentActivity", int(slot.entered))
        ad.set("Draining", self.drain is not None)
        if self.drain is not None:
            ad.set("DrainReason", self.drain.reason)
            ad.set("DrainingRequestId", self.drain.request_id)
        ad.set_expr("Start", self.settings.start_expr)
        with contextlib.suppress(ClassAdSyntaxError):
            ad.set_expr("MaxJobRetirementTime", self.settings.retirement_expr)
        ad.set("LastDrainStartTime", int(self.drain.started_at) if self.drain else 0)
        job = slot.job
        if job is not None:
            ad.set("JobId", job.job_id)
            ad.set("GlobalJobId", f"submit.emulated#{job.job_id}#{int(job.claimed_at)}")
            ad.set("RemoteOwner", f"{job.owner}@emulated")
            ad.set("RemoteUser", f"{job.owner}@emulated")
            ad.set("ClientMachine", "submit.emulated")
            ad.set("JobStart", int(job.claimed_at))
            ad.set("TotalJobRunTime", int(time.time() - job.claimed_at))
        ad.update(self.extras)
        return ad

    def job_ad(self, job: Job) -> Ad:
        cluster, proc = job.cluster_proc
        ad = Ad()
        ad.set("MyType", "Job")
        ad.set("ClusterId", cluster)
        ad.set("ProcId", proc)
        ad.set("Owner", job.owner)
        ad.set("User", f"{job.owner}@emulated")
        ad.set("GlobalJobId", f"submit.emulated#{job.job_id}#{int(job.claimed_at)}")
        ad.set("Cmd", "/bin/sleep")
        ad.set("Arguments", f"{job.duration_s:g}")
        ad.set("RequestCpus", 1)
        ad.set("JobUniverse", 5)
        ad.set("RemoteHost", job.slot.name)
        ad.set("QDate", int(job.claimed_at))
        return ad

    # ------------------------------------------------------------------ claiming

    def _start_true(self, slot: Slot, job_ad: Ad) -> bool:
        expr = self.settings.start_expr
        if self.drain is not None:
            # while draining START is the -start expression, else undefined: no match
            if self.drain.start_expr is None:
                return False
            expr = self.drain.start_expr
        return evaluate(expr, self.slot_ad(slot).nodes, job_ad.nodes) is True

    def _pick_slot(self, job: Job) -> tuple[Slot | None, str]:
        probe = self.job_ad(job)
        if self.settings.partitionable:
            parent = self.slots[0]
            used = sum(s.cpus for s in self.slots[1:])
            if parent.cpus - used < 1:
                return None, "no free slot"
            if not self._start_true(parent, probe):
                return None, "draining" if self.drain else "START is false"
            slot = Slot(
                f"slot1_{parent.next_dynamic}@{self.settings.startd_name}",
                1,
                "Dynamic",
                1,
            )
            parent.next_dynamic += 1
            self.slots.append(slot)
            return slot, ""
        free = [slot for slot in self.slots if slot.job is None and slot.state == "Unclaimed"]
        if not free and self.drain is None:
            return None, "no free slot"
        for slot in free:
            if self._start_true(slot, probe):
                return slot, ""
        if self.drain is not None:
            return None, "draining"
        return None, "START is false"

    def _release(self, job: Job) -> None:
        slot = job.slot
        job.phase = "done"
        if job.retire_timer is not None:
            job.retire_timer.cancel()
        slot.job = None
        self._no_jobs.set()
        if slot.kind == "Dynamic":
            with contextlib.suppress(ValueError):
                self.slots.remove(slot)
        elif self.drain is not None:
            slot.enter("Drained", "Idle")
        else:
            slot.enter("Unclaimed", "Idle")
        self._check_drain_done()

    async def offer(
        self, job_id: str, duration_s: float, exit_code: int, owner: str
    ) -> dict[str, Any]:
        """Offer one job, as the overlay pool's negotiator and schedd would"""
        if self.shutting_down or not self.startd_ready:
            reason = "shutting down" if self.shutting_down else "no startd"
            self.truth.record("offer_rejected", job_id=job_id, reason=reason)
            return {"outcome": "rejected", "reason": reason}
        self.jobs += 1
        placeholder = Slot("", 0, "Static", 1)
        job = Job(job_id, owner, duration_s, exit_code, placeholder, time.time(), self.jobs)
        slot, reason = self._pick_slot(job)
        if slot is None:
            self.truth.record("offer_rejected", job_id=job_id, reason=reason)
            return {"outcome": "rejected", "reason": reason}
        job.slot = slot
        slot.job = job
        # the claim is activated before the starter runs PREPARE_JOB
        slot.enter("Claimed", "Busy")
        self.truth.record("claimed", job_id=job_id, slot=slot.name)
        decision, detail = await self._prepare_job(job)
        if job.kill_reason is not None:
            self.truth.record(
                "payload_vacated", job_id=job_id, slot=slot.name, reason=job.kill_reason
            )
            self._release(job)
            return {"outcome": "vacated", "reason": job.kill_reason, "slot": slot.name}
        if decision != "run":
            event = "payload_held" if decision == "hold" else "payload_refused"
            self.truth.record(event, job_id=job_id, slot=slot.name, **detail)
            self._release(job)
            return {
                "outcome": "held" if decision == "hold" else "idle",
                "slot": slot.name,
                **detail,
            }
        job.phase = "running"
        job.started_at, job.started_mono = time.time(), time.monotonic()
        job.sleeper = asyncio.get_running_loop().create_task(asyncio.sleep(duration_s))
        self.truth.record("payload_started", job_id=job_id, slot=slot.name, duration_s=duration_s)
        self._spawn(self._run_payload(job))
        if self._stopping_fast():  # a shutdown may have begun while PREPARE_JOB ran
            self._kill(job, "shutdown_fast")
        elif self.drain is not None and self.drain.how == "graceful":
            slot.enter("Claimed", "Retiring")
            self._schedule_kill(job, self._retirement_left(job), "retirement_expired")
        elif self.drain is not None:
            self._kill(job, f"drain_{self.drain.how}")
        return {"outcome": "started", "slot": slot.name}

    def _stopping_fast(self) -> bool:
        return self.shutting_down == "fast"

    def _scratch(self, job: Job) -> Path:
        path = self.settings.state_dir / "execute" / f"dir_{self.pid}_{job.number}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _hook_env(self, job: Job, scratch: Path) -> dict[str, str]:
        (scratch / ".job.ad").write_text(self.job_ad(job).long())
        (scratch / ".machine.ad").write_text(self.slot_ad(job.slot).long())
        return {
            **os.environ,
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_JOB_AD": str(scratch / ".job.ad"),
            "_CONDOR_MACHINE_AD": str(scratch / ".machine.ad"),
        }

    async def _prepare_job(self, job: Job) -> tuple[str, dict[str, Any]]:
        """Run PREPARE_JOB as the starter does; ``run``, ``idle`` or ``hold`` and details"""
        argv = self.settings.prepare_job
        if not argv:
            return "run", {}
        scratch = self._scratch(job)
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=scratch,
                env=self._hook_env(job, scratch),
            )
        except OSError as err:
            detail = {"hold_subcode": 0, "message": f"failed to execute HOOK_PREPARE_JOB: {err}"}
            self.truth.record(
                "prepare_job", job_id=job.job_id, decision="hold", spawned=False, **detail
            )
            return "hold", detail
        job.hook = proc
        out, errout = await proc.communicate(self.job_ad(job).long().encode())
        job.hook = None
        wall = time.monotonic() - started
        stdout = out.decode("utf-8", errors="replace")
        exit_status = proc.returncode if proc.returncode is not None else -1
        code_match = _STATUS_CODE_RE.search(stdout)
        message_match = _STATUS_MESSAGE_RE.search(stdout)
        message = re.sub(r"\\(.)", r"\1", message_match.group(1)) if message_match else ""
        hook_code = int(code_match.group(1)) if code_match else None
        if exit_status < 0:
            status = exit_status  # killed by a signal: HookStatusCode is ignored
        elif hook_code is not None and hook_code >= 0:
            status = hook_code
        else:
            status = exit_status
        if status == 0:
            decision = "run"
        elif status < 0 or status >= 300:
            decision = "idle"
        else:
            decision = "hold"
        self.truth.record(
            "prepare_job",
            job_id=job.job_id,
            slot=job.slot.name,
            exit_status=exit_status,
            hook_status_code=hook_code,
            message=message,
            wall_s=round(wall, 4),
            decision=decision,
            stderr=errout.decode("utf-8", errors="replace")[-2000:],
        )
        if decision == "hold":
            return "hold", {"hold_reason_code": 19, "hold_subcode": status, "message": message}
        return decision, {"status": status, "message": message}

    async def _run_payload(self, job: Job) -> None:
        assert job.sleeper is not None
        this = asyncio.current_task()
        how, exit_code = "exit", job.exit_code
        try:
            await job.sleeper
        except asyncio.CancelledError:
            if this is not None and this.cancelling():
                raise  # the emulator itself is stopping
            how, exit_code = "evict", -9
        runtime = time.monotonic() - (job.started_mono or time.monotonic())
        if how == "exit":
            self.truth.record(
                "payload_finished",
                job_id=job.job_id,
                slot=job.slot.name,
                exit_code=exit_code,
                runtime_s=round(runtime, 3),
            )
        else:
            self.truth.record(
                "payload_killed",
                job_id=job.job_id,
                slot=job.slot.name,
                reason=job.kill_reason,
                runtime_s=round(runtime, 3),
            )
        job.phase = "exit_hook"
        await self._job_exit_hook(job, how, exit_code, runtime)
        self._release(job)

    async def _job_exit_hook(self, job: Job, reason: str, exit_code: int, runtime: float) -> None:
        argv = self.settings.job_exit
        if not argv:
            return
        ad = self.job_ad(job)
        if exit_code >= 0:
            ad.set("ExitBySignal", False)
            ad.set("ExitCode", exit_code)
        else:
            ad.set("ExitBySignal", True)
            ad.set("ExitSignal", -exit_code)
        ad.set("JobDuration", round(runtime, 3))
        ad.set("ExitReason", "exited normally" if reason == "exit" else "evicted")
        scratch = self._scratch(job)
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                reason,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                cwd=scratch,
                env=self._hook_env(job, scratch),
            )
        except OSError as err:
            self.truth.record(
                "job_exit", job_id=job.job_id, reason=reason, spawned=False, error=str(err)
            )
            return
        timed_out = False
        try:
            async with asyncio.timeout(self.settings.job_exit_timeout_s):
                _, errout = await proc.communicate(ad.long().encode())
        except TimeoutError:
            timed_out = True
            proc.kill()
            await proc.wait()
            errout = b""
        self.truth.record(
            "job_exit",
            job_id=job.job_id,
            reason=reason,
            exit_status=proc.returncode,
            timed_out=timed_out,
            wall_s=round(time.monotonic() - started, 4),
            stderr=errout.decode("utf-8", errors="replace")[-2000:],
        )

    # ------------------------------------------------------------------ killing and draining

    def _retirement_s(self, job: Job) -> float:
        value = evaluate(
            self.settings.retirement_expr, self.slot_ad(job.slot).nodes, self.job_ad(job).nodes
        )
        if isinstance(value, bool) or not isinstance(value, int | float):
            return 0.0
        return max(0.0, float(value))

    def _retirement_left(self, job: Job) -> float:
        return max(0.0, job.claimed_at + self._retirement_s(job) - time.time())

    def _schedule_kill(self, job: Job, delay_s: float, reason: str) -> None:
        if job.retire_timer is not None:
            job.retire_timer.cancel()
        if delay_s > 1e8:
            return  # "forever" (MaxJobRetirementTime = 10000000 and the like)
        job.retire_timer = asyncio.get_running_loop().call_later(delay_s, self._kill, job, reason)

    def _kill(self, job: Job, reason: str) -> None:
        if job.phase == "prepare":
            if job.kill_reason is None:
                job.kill_reason = reason
            if job.hook is not None and job.hook.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    job.hook.kill()
        elif job.phase == "running" and job.sleeper is not None and not job.sleeper.done():
            if job.kill_reason is None:
                job.kill_reason = reason
            job.sleeper.cancel()

    def start_drain(
        self,
        how: str,
        on_completion: str,
        reason: str,
        check: str | None,
        start: str | None,
    ) -> dict[str, Any]:
        """``ResMgr::startDraining``: atomic with respect to claims (one loop step)"""
        if self.drain is not None:
            return self._drain_refused(
                DRAINING_ALREADY_IN_PROGRESS,
                "Draining already in progress.",
                how,
                on_completion,
                reason,
            )
        if check is not None:
            for slot in self.slots:
                value = evaluate(check, self.slot_ad(slot).nodes)
                if value is ERROR:
                    msg = f"Failed to evaluate draining check expression against {slot.name}."
                elif not isinstance(value, bool):
                    msg = f"Draining check expression does not evaluate to a bool on {slot.name}."
                elif not value:
                    msg = f"Draining check expression is false on {slot.name}."
                else:
                    continue
                return self._drain_refused(
                    DRAINING_CHECK_EXPR_FAILED, msg, how, on_completion, reason
                )
        self.drain_requests += 1
        self.drain = Drain(str(self.drain_requests), how, on_completion, reason, start, time.time())
        self.truth.record(
            "drain_requested",
            accepted=True,
            how=how,
            on_completion=on_completion,
            reason=reason,
            check=check,
            request_id=self.drain.request_id,
        )
        for slot in list(self.slots):
            job = slot.job
            if job is None:
                slot.enter("Drained", "Idle")
            elif how == "graceful":
                slot.enter("Claimed", "Retiring")
                self._schedule_kill(job, self._retirement_left(job), "retirement_expired")
            else:
                self._kill(job, f"drain_{how}")
        self._check_drain_done()
        return {"ok": True, "request_id": self.drain.request_id}

    def _drain_refused(
        self, code: int, message: str, how: str, on_completion: str, reason: str
    ) -> dict[str, Any]:
        self.truth.record(
            "drain_requested",
            accepted=False,
            error_code=code,
            message=message,
            how=how,
            on_completion=on_completion,
            reason=reason,
        )
        return {"ok": False, "error_code": code, "error": message}

    def cancel_drain(self, request_id: str | None) -> dict[str, Any]:
        if self.drain is None:
            if request_id is not None:
                return {
                    "ok": False,
                    "error_code": DRAINING_NO_MATCHING_REQUEST_ID,
                    "error": f"No draining request with id {request_id}.",
                }
            return {"ok": True}
        if request_id is not None and request_id != self.drain.request_id:
            return {
                "ok": False,
                "error_code": DRAINING_NO_MATCHING_REQUEST_ID,
                "error": f"No draining request with id {request_id}.",
            }
        self.truth.record("drain_cancelled", request_id=self.drain.request_id)
        self.drain = None
        self._resume_slots()
        return {"ok": True}

    def _resume_slots(self) -> None:
        for slot in self.slots:
            if slot.job is not None:
                if slot.job.retire_timer is not None:
                    slot.job.retire_timer.cancel()
                slot.enter("Claimed", "Busy")
            else:
                slot.enter("Unclaimed", "Idle")

    def _check_drain_done(self) -> None:
        drain = self.drain
        if drain is None or any(slot.job is not None for slot in self.slots):
            return
        self.truth.record(
            "drain_completed", request_id=drain.request_id, on_completion=drain.on_completion
        )
        if drain.on_completion == "exit":
            self._stop_startd("drain completed (-exit-on-completion)", held=True)
        elif drain.on_completion == "restart":
            self._stop_startd("drain completed (-restart-on-completion)", held=False)
            self._spawn(self._start_startd())
        elif drain.on_completion in ("resume", "reconfig"):
            self.drain = None
            self._resume_slots()

    def restart_startd(self) -> dict[str, Any]:
        """Emulate a startd crash and restart by the master (only when no job runs)"""
        if any(slot.job for slot in self.slots):
            return {"ok": False, "error": "jobs are running"}
        self._stop_startd("restarted", held=False)
        self._spawn(self._start_startd())
        return {"ok": True}

    def update_machine_ad(self, text: str) -> dict[str, Any]:
        """``CA_UPDATE_MACHINE_AD``: merge into every slot ad until the startd restarts"""
        if not self.startd_running:
            return {"ok": False, "error": "startd not running"}
        try:
            update = Ad.from_long(text)
        except ClassAdSyntaxError as err:
            return {"ok": False, "error": str(err)}
        for key, name in update.names.items():
            self.truth.record("gate", attribute=name, value=update.source[key])
        self.extras.update(update)
        return {"ok": True}

    # ------------------------------------------------------------------ control socket

    def status(self) -> dict[str, Any]:
        return {
            "master_pid": self.pid,
            "startd_running": self.startd_running,
            "startd_ready": self.startd_ready,
            "startd_pid": self.startd_pid,
            "startd_name": self.settings.startd_name,
            "startd_address": self.startd_address,
            "draining": dataclasses.asdict(self.drain) if self.drain else None,
            "shutting_down": self.shutting_down,
            "extras": {self.extras.names[k]: self.extras.source[k] for k in self.extras.names},
            "slots": [
                {
                    "name": slot.name,
                    "state": slot.state,
                    "activity": slot.activity,
                    "job_id": slot.job.job_id if slot.job else None,
                    "phase": slot.job.phase if slot.job else None,
                }
                for slot in self.slots
            ],
        }

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ready_ad":
            return {"ok": True, "ad": self.ready_ad().long()}
        if op == "slot_ads":
            if not self.startd_running:
                return {"ok": True, "running": False, "ads": []}
            ads = [self.slot_ad(slot).long() for slot in self.slots if slot.job is not None]
            return {"ok": True, "running": True, "ads": ads}
        if op == "locate":
            return {
                "ok": True,
                "running": self.startd_running,
                "name": self.settings.startd_name,
                "address": self.startd_address,
                "host": self.settings.host,
            }
        if op == "update_machine_ad":
            return self.update_machine_ad(str(request.get("ad", "")))
        if op == "drain":
            if not self.startd_running:
                return {"ok": False, "unreachable": True}
            how = request.get("how", "graceful")
            completion = request.get("on_completion", "nothing")
            if how not in DRAIN_HOW or completion not in COMPLETION:
                return {"ok": False, "error": "bad drain request"}
            return self.start_drain(
                how,
                completion,
                str(request.get("reason") or ""),
                request.get("check"),
                request.get("start"),
            )
        if op == "cancel_drain":
            if not self.startd_running:
                return {"ok": False, "unreachable": True}
            return self.cancel_drain(request.get("request_id"))
        if op == "offer":
            return {
                "ok": True,
                **await self.offer(
                    str(request["job_id"]),
                    float(request.get("duration_s", 1.0)),
                    int(request.get("exit_code", 0)),
                    str(request.get("owner", "emulated")),
                ),
            }
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "restart_startd":
            return self.restart_startd()
        if op == "shutdown":
            self._on_signal(
                signal.SIGQUIT if request.get("fast") else signal.SIGTERM,
                "fast" if request.get("fast") else "graceful",
            )
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}


def run_master(config: Config) -> int:
    """Run the emulated master in the foreground until it exits; its exit code"""
    settings = Settings.from_config(config)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(EmulatedStartd(settings).run())


__all__ = ["UNDEFINED", "EmulatedStartd", "Node", "Settings", "run_master"]
