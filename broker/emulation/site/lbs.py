"""
An emulated local batch system (LBS): the site that runs TARDIS's drone jobs

Its rule: a job is a local process tree in its own sandbox, tracked as a family like
HTCondor's procd, so that ``rm`` (SIGTERM, then SIGKILL after ``vacate_s``) and ``suspend``
reach every process it ever started, payloads included.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from broker.emulation.groundtruth import GroundTruth
from broker.emulation.service import Service

log = logging.getLogger("emulation.lbs")

#: HTCondor JobStatus codes used here
IDLE, RUNNING, REMOVED, COMPLETED, SUSPENDED = 1, 2, 3, 4, 7


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, start time)`` of a live process, ``None`` if it is gone or a zombie"""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


class ProcessFamily:
    """
    Every process a job ever started, as HTCondor's procd tracks it

    Members are remembered with their start time, so a reused PID is never
    signalled. :meth:`refresh` adds the descendants of every live member.
    """

    def __init__(self, root: int) -> None:
        stat = _stat(root)
        self.members: dict[int, int] = {root: stat[1]} if stat else {}

    def refresh(self) -> None:
        children: dict[int, list[tuple[int, int]]] = {}
        with os.scandir("/proc") as entries:
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                stat = _stat(int(entry.name))
                if stat is not None:
                    children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
        stack = [pid for pid in self.members if self._alive(pid)]
        while stack:
            for child, started in children.get(stack.pop(), []):
                if self.members.get(child) != started:
                    self.members[child] = started
                    stack.append(child)

    def _alive(self, pid: int) -> bool:
        stat = _stat(pid)
        return stat is not None and stat[1] == self.members.get(pid)

    def alive(self) -> list[int]:
        return [pid for pid in self.members if self._alive(pid)]

    def signal(self, sig: signal.Signals) -> int:
        """Send ``sig`` to every live member; how many got it"""
        count = 0
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                count += 1
        return count


@dataclasses.dataclass(eq=False)
class Job:
    job_id: str
    drone: str
    env: dict[str, str]
    submitted: float
    queue_delay_s: float
    sandbox: Path
    status: int = IDLE
    started: float | None = None
    ended: float | None = None
    proc: asyncio.subprocess.Process | None = None
    family: ProcessFamily | None = None
    removed: bool = False
    #: the submit description's ``executable``, where a fake condor_submit gave one
    executable: str = ""


#: builds a job's command and environment: ``(job) -> (argv, env)``; the env
#: returned is the whole environment of the job
Launcher = Callable[[Job], tuple[Sequence[str], Mapping[str, str]]]


class LocalBatchSystem:
    """
    The emulated schedd: a queue, a scheduler with a delay per job, a starter

    Its socket answers ``submit``, ``q`` (every job still in the queue with HTCondor's
    ``JobStatus``: 1 idle, 2 running, 7 suspended), ``rm`` and ``suspend``. Its ground truth:
    ``job_submitted``, ``job_started``, ``job_suspended``, ``job_removed`` (``was``: idle,
    running, suspended), ``job_exited`` (``returncode``, ``removed``), ``job_killed_at_teardown``.

    :param workdir: where job sandboxes (``jobs/<id>``) and the socket live
    :param launcher: what each job runs
    :param queue_delay: seconds the ``n``-th submitted job (from 0) waits in the queue
    :param truth: the ground-truth file
    :param vacate_s: seconds between SIGTERM and SIGKILL on removal
    :param on_start: called with each job that starts (the overlay pool uses it)
    :param on_end: called with each job that ends
    """

    def __init__(
        self,
        workdir: Path,
        launcher: Launcher,
        queue_delay: Callable[[int], float],
        truth: GroundTruth,
        *,
        vacate_s: float = 1.0,
        on_start: Callable[[Job], None] | None = None,
        on_end: Callable[[Job], None] | None = None,
    ) -> None:
        self.workdir = workdir
        self.socket = workdir / "lbs.sock"
        self.launcher = launcher
        self.queue_delay = queue_delay
        self.truth = truth
        self.vacate_s = vacate_s
        self.on_start = on_start
        self.on_end = on_end
        self.jobs: dict[str, Job] = {}
        self._cluster = 0
        self._service = Service(self.socket, self.handle)

    # ------------------------------------------------------------ service

    async def start(self) -> None:
        await self._service.start(self._track_families)

    async def close(self) -> None:
        """Stop serving and kill every job that still runs (by its process family)"""
        self._service.stop_serving()
        for job in self.jobs.values():
            if job.status in (RUNNING, SUSPENDED) and job.family is not None:
                job.family.refresh()
                self.truth.record("job_killed_at_teardown", job_id=job.job_id, drone=job.drone)
                job.family.signal(signal.SIGCONT)
                job.family.signal(signal.SIGKILL)
        waits = [job.proc.wait() for job in self.jobs.values() if job.proc is not None]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), 20)
        await self._service.tasks.cancel()
        families = [job.family for job in self.jobs.values() if job.family is not None]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # stragglers that left the job's session
            alive = [family for family in families if family.alive()]
            if not alive:
                break
            for family in alive:
                family.signal(signal.SIGKILL)
            await asyncio.sleep(0.05)

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "submit":
            job = self.submit(
                str(request["drone"]),
                dict(request.get("env") or {}),
                str(request.get("executable") or ""),
            )
            return {"ok": True, "job_id": job.job_id}
        if op == "q":
            return {
                "ok": True,
                # a removed job stays listed (JobStatus 3) until its processes are gone
                "jobs": {job.job_id: job.status for job in self.jobs.values() if job.ended is None},
            }
        if op in ("rm", "suspend"):
            ids = [str(i) for i in request.get("job_ids", [])]
            act = self.remove if op == "rm" else self.suspend
            return {"ok": True, "done": {job_id: act(job_id) for job_id in ids}}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ------------------------------------------------------------ queue

    def submit(self, drone: str, env: dict[str, str], executable: str = "") -> Job:
        index = self._cluster
        self._cluster += 1
        job_id = f"{index + 1}.0"
        delay = float(self.queue_delay(index))
        job = Job(
            job_id=job_id,
            drone=drone,
            env=env,
            submitted=time.time(),
            queue_delay_s=delay,
            sandbox=self.workdir / "jobs" / job_id.replace(".", "_"),
            executable=executable,
        )
        self.jobs[job_id] = job
        self.truth.record(
            "job_submitted",
            job_id=job_id,
            drone=drone,
            queue_delay_s=delay,
            **({"executable": executable} if executable else {}),
        )
        self._service.tasks.spawn(self._schedule(job))
        return job

    async def _schedule(self, job: Job) -> None:
        await asyncio.sleep(job.queue_delay_s)
        if job.status != IDLE:
            return
        job.sandbox.mkdir(parents=True, exist_ok=True)
        argv, env = self.launcher(job)
        log_file = (job.sandbox / "job.log").open("wb")
        try:
            job.proc = await asyncio.create_subprocess_exec(
                *argv,
                env=dict(env),
                cwd=job.sandbox,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as err:
            log_file.close()
            job.status, job.ended = COMPLETED, time.time()
            self.truth.record("job_exited", job_id=job.job_id, drone=job.drone, error=str(err))
            return
        log_file.close()
        job.status, job.started = RUNNING, time.time()
        job.family = ProcessFamily(job.proc.pid)
        self.truth.record(
            "job_started",
            job_id=job.job_id,
            drone=job.drone,
            pid=job.proc.pid,
            sandbox=str(job.sandbox),
            queue_delay_s=job.queue_delay_s,
        )
        if self.on_start is not None:
            self.on_start(job)
        returncode = await job.proc.wait()
        job.status, job.ended = COMPLETED, time.time()
        self.truth.record(
            "job_exited",
            job_id=job.job_id,
            drone=job.drone,
            returncode=returncode,
            removed=job.removed,
        )
        if self.on_end is not None:
            self.on_end(job)

    async def _track_families(self) -> None:
        while True:
            for job in list(self.jobs.values()):
                if job.status in (RUNNING, SUSPENDED) and job.family is not None:
                    job.family.refresh()
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------ tools

    def remove(self, job_id: str) -> bool:
        """``condor_rm``: ``False`` if the job is not in the queue"""
        job = self.jobs.get(job_id)
        if job is None or job.status not in (IDLE, RUNNING, SUSPENDED) or job.removed:
            return False
        was = {IDLE: "idle", RUNNING: "running", SUSPENDED: "suspended"}[job.status]
        job.removed = True
        self.truth.record("job_removed", job_id=job_id, drone=job.drone, was=was)
        if job.status == IDLE:
            job.status, job.ended = REMOVED, time.time()
            return True
        job.status = REMOVED
        self._service.tasks.spawn(self._kill(job))
        return True

    async def _kill(self, job: Job) -> None:
        family, proc = job.family, job.proc
        assert family is not None and proc is not None
        family.refresh()
        family.signal(signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.vacate_s
        while time.monotonic() < deadline and family.alive():
            await asyncio.sleep(0.05)
            family.refresh()
        family.signal(signal.SIGKILL)

    def suspend(self, job_id: str) -> bool:
        """``condor_suspend``: ``False`` unless the job runs"""
        job = self.jobs.get(job_id)
        if job is None or job.status != RUNNING or job.family is None:
            return False
        job.family.refresh()
        job.family.signal(signal.SIGSTOP)
        job.status = SUSPENDED
        self.truth.record("job_suspended", job_id=job_id, drone=job.drone)
        return True
