"""
The drone agent: supervises the worker, publishes the drone's lifecycle, obeys commands

One :class:`Agent` runs inside each drone job (``cobald-remote agent run``). It

* starts the worker (normally ``condor_master -f``) at once, whether or not the
  broker is reachable, forwards SIGTERM/SIGINT to it and exits with its status;
* keeps the drone's lifecycle (:mod:`remote_agent.agent.state`) and publishes every
  change as an event with the drone's sequence number, dedupe id and full
  snapshot, plus a heartbeat every ``heartbeat_s``, through the spool and the
  ordered :class:`~remote_agent.publisher.Publisher`;
* claims its handshake record before its gate may open, and acts on what the
  record says (released, draining) when it connects, reconnects and heartbeats;
* answers the starter's job hooks through :class:`~remote_agent.interfaces.GateHandler`
  and the manager's commands on its command subject, all in one event loop, so
  that a payload start and a drain never interleave.

``docs/agent.md`` describes the behaviour for operators; ``docs/handshake.md``
why the release is race-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from remote_agent import __version__
from remote_agent.agent.state import Lifecycle
from remote_agent.errors import StartdError
from remote_agent.interfaces import (
    GATE_CLOSED_STATUS,
    SELF_EXIT_STATUSES,
    GateDecision,
    JobStart,
    SlotInfo,
    Startd,
)
from remote_agent.protocol.backoff import Backoff
from remote_agent.protocol.errors import HandshakeError, SchemaError
from remote_agent.protocol.events import (
    MAX_COMMAND,
    MAX_JOB_ID,
    MAX_NAME,
    MAX_PAYLOADS,
    MAX_REQUEST_ID,
    MAX_TEXT,
    AgentExiting,
    AgentStarted,
    DrainAccepted,
    DrainCommand,
    DrainDeadlineExpired,
    Drained,
    Draining,
    DrainIntent,
    DrainRefused,
    DrainRequested,
    DroneRecord,
    DroneState,
    ErrorReply,
    Event,
    GateClosed,
    GateOpened,
    Heartbeat,
    Outcome,
    Payload,
    PayloadEnd,
    PayloadFinished,
    PayloadStarted,
    RecordPhase,
    Released,
    ReleaseIfIdleCommand,
    Reply,
    Snapshot,
    StartdReady,
    StatusCommand,
    WorkerExited,
    WorkerStarted,
    decode_command,
    encode,
    kind_of,
    utcnow,
)
from remote_agent.protocol.handshake import CLOSED_PHASES, RecordStore, Versioned
from remote_agent.protocol.names import Namespace, dedupe_id, inbox_prefix, kv_stream, kv_subjects
from remote_agent.protocol.ratelog import RateLimitedLog
from remote_agent.publisher import Publisher
from remote_agent.settings import Settings
from remote_agent.spool import Spool, SpooledEvent

log = logging.getLogger(__name__)
_rejections = RateLimitedLog(log)

S = DroneState
E = TypeVar("E", bound=Event)

#: how long a refused or finished job id is remembered, so a late poll does not adopt it
_FORGET_S = 600.0
#: seconds between readiness checks of a startd that is up
_READY_CHECK_S = 30.0
#: how long a command reply waits for the record write of a release-if-idle
_REPLY_RECORD_WAIT_S = 2.0
#: refused and finished job ids remembered at most (a flood of forged ids costs no memory)
_MAX_REMEMBERED = 4096


def _cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and ``...``"""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded_command(command: Iterable[str]) -> list[str]:
    """The worker command line for an event: at most :data:`MAX_COMMAND` characters"""
    result: list[str] = []
    left = MAX_COMMAND
    for arg in command:
        if len(arg) > left:
            result.append(_cut(arg, max(left, 3)) if left >= 3 else "...")
            break
        result.append(arg)
        left -= len(arg)
    return result


def bounded_intent(intent: DrainIntent) -> DrainIntent:
    """``intent`` with its reason and request id cut to the snapshot limits"""
    if len(intent.reason) <= MAX_TEXT and len(intent.request_id) <= MAX_REQUEST_ID:
        return intent
    return msgspec.structs.replace(
        intent,
        reason=_cut(intent.reason, MAX_TEXT),
        request_id=_cut(intent.request_id, MAX_REQUEST_ID),
    )


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], budget_s: float = 10.0) -> None:
    """
    Cancel ``tasks`` and wait until they are done, cancelling again while they run

    Repeated because nats-py swallows a cancellation that arrives while it hands a
    message to its flusher (``Client._flush_pending``): the task then carries on
    until its next await, where the next cancellation lands.
    """
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + budget_s
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    if pending:
        log.error("tasks did not stop: %s", ", ".join(sorted(t.get_name() for t in pending)))


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` for signal ``N``"""
    return returncode if returncode >= 0 else 128 - returncode


class Agent:
    """
    The agent of one drone; ``await run()`` returns the exit code

    :param settings: the validated configuration
    :param startd: the local startd, asked through ``condor_*`` tools; ignored
        (and not needed) when ``settings.startd`` is false
    :param worker_env: extra environment of the worker, e.g. where the gate
        socket is, so that the startd's job hooks find the agent
    """

    def __init__(
        self,
        settings: Settings,
        *,
        startd: Startd | None = None,
        worker_env: Mapping[str, str] | None = None,
    ) -> None:
        if settings.startd and startd is None:
            raise ValueError("settings.startd is set but no Startd was given")
        self.settings = settings
        self.startd = startd if settings.startd else None
        self.namespace = Namespace(settings.prefix)
        #: this run of the agent; a restarted agent has another one
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = utcnow()
        self.lifecycle = Lifecycle(self.started_at)
        #: things counted for operators: refused payloads, bad commands, ...
        self.counters: Counter[str] = Counter()
        #: extra environment of the worker (e.g. where the gate socket is); set before run()
        self.worker_env = dict(worker_env or {})
        self._site = settings.site
        self._drone = settings.drone
        self._domain = settings.domain

        self._payloads: dict[str, Payload] = {}
        self._payloads_done = asyncio.Event()
        self._payloads_done.set()
        self._gate_open = False
        #: the gate is shut for good (drain, release, exit): nothing opens it again
        self._sealed = False
        self._claimed = False
        self._released = False
        self._drain: DrainIntent | None = None
        self._ending: str | None = None
        self._terminated = False
        self._stop_signal: int | None = None
        self._slots = settings.slots
        self._startd_ready = False
        self._accepting: bool | None = None
        self._accepting_lock = asyncio.Lock()

        self._worker: asyncio.subprocess.Process | None = None
        self._spool: Spool | None = None
        self._publisher: Publisher | None = None
        self._store: RecordStore | None = None
        self._seq = 0
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._winding_down = False
        self._claimable = asyncio.Event()
        self._recheck = asyncio.Event()
        self._listening = asyncio.Event()  # the command and record-hint subscriptions are in
        self._release_recorded: asyncio.Event | None = None

        #: payloads let in (or adopted) so far: a release-if-idle that saw another
        #: number before it asked the startd lets nothing go
        self._admitted = 0
        #: the handshake record was released, deleted or rewritten while the agent was
        #: up: the gate is shut and the agent never writes the record again
        self._record_lost: str | None = None
        #: busy slots at the last look at the startd (-1: it did not answer)
        self._busy_slots = 0
        #: the incarnation of the record this agent claimed (an earlier one's drain)
        self._claimed_incarnation = self.incarnation
        self._refused: dict[str, float] = {}
        self._finished: dict[str, float] = {}
        self._unknown_seen: set[str] = set()
        self._missing: dict[str, int] = {}

    # ================================================================== queries

    @property
    def state(self) -> DroneState:
        return self.lifecycle.state

    @property
    def gate_open(self) -> bool:
        return self._gate_open

    @property
    def payloads(self) -> list[Payload]:
        return list(self._payloads.values())

    @property
    def publisher(self) -> Publisher | None:
        return self._publisher

    def snapshot(self) -> Snapshot:
        """The drone's whole state as the agent knows it now"""
        worker = self._worker
        running = worker is not None and worker.returncode is None
        return Snapshot(
            state=self.lifecycle.state,
            since=self.lifecycle.since,
            gate_open=self._gate_open,
            slots=self._slots,
            payloads=list(self._payloads.values()),
            drain=self._drain,
            worker_pid=worker.pid if running and worker is not None else None,
            started_at=self.started_at,
        )

    # ================================================================== run

    async def run(self, *, handle_signals: bool = False) -> int:
        """
        Run the drone until its worker has ended; the result is the exit code

        :param handle_signals: forward SIGTERM and SIGINT to the worker (the
            command line does; tests call :meth:`request_stop` instead)
        :raises SpoolError: if the spool directory cannot be used
        """
        settings = self.settings
        self._spool = Spool.open(settings.spool_dir, settings.spool_max_events)
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop, sig)
        try:
            last = self._spool.last_seq
            # docs/protocol.md: start above both the spooled seq and the clock in µs
            self._seq = max(-1 if last is None else last, time.time_ns() // 1000 - 1)
            self._publisher = Publisher(
                self._spool,
                settings.servers,
                name=f"cobald-remote-agent-{self._drone}",
                creds=settings.creds,
                inbox_prefix=inbox_prefix(self._drone),
                publish_timeout_s=settings.publish_timeout_s,
                reconnect_wait_s=settings.reconnect_wait_s,
                domain=settings.domain,
            )
            self._publisher.on_connect(self._recheck.set)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                bus = tg.create_task(self._publisher.run(), name="publisher")
                try:
                    try:
                        code = await self._lifecycle()
                    except BaseException:
                        await self._kill_worker()
                        raise
                    finally:
                        await self._cancel_background()
                    if not await self._publisher.flush(settings.exit_flush_s):
                        log.warning(
                            "exiting with %d events unpublished (broker unreachable for %.0fs)",
                            len(self._spool),
                            settings.exit_flush_s,
                            extra={"drone": self._drone},
                        )
                finally:
                    # however the agent ends (also cancelled while it flushes its last
                    # events): the task group cancels each task once, and nats-py may
                    # swallow that (see stop_tasks); a publisher that carried on would
                    # keep the group, and so the agent, from ever ending
                    await stop_tasks([bus, *self._tasks])
                    await self._publisher.close()
            log.info("agent exits with %d", code, extra={"drone": self._drone})
            return code
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            self._spool.close()

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """
        The batch system asks the drone job to end: close the gate, pass the signal on

        The agent exits once the worker has ended, with the worker's status.
        """
        name = signal.Signals(signum).name
        log.info("received %s, forwarding it to the worker", name, extra={"drone": self._drone})
        self._stop_signal = signum
        was_open = self._seal_gate()
        if self.lifecycle.state is not S.EXITING:
            self.lifecycle.move(S.EXITING)
        if was_open:
            self._emit(GateClosed, reason=f"the agent received {name}")
        worker = self._worker
        if worker is not None and worker.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.send_signal(signum)

    async def _lifecycle(self) -> int:
        settings = self.settings
        command = list(settings.worker_command)
        self._emit(
            AgentStarted,
            agent_version=__version__,
            hostname=_cut(socket.gethostname(), MAX_NAME),
            pid=os.getpid(),
            worker_command=bounded_command(command),
        )
        self._spawn(self._serve(), "serve")
        self._spawn(self._heartbeats(), "heartbeat")
        self._spawn(self._watch_record(), "watch-record")
        self._spawn(self._claim(), "claim")
        if self._stop_signal is not None:
            return await self._give_up(128 + self._stop_signal, "stopped before the worker started")
        try:
            env = {**os.environ, **self.worker_env}
            worker = await asyncio.create_subprocess_exec(
                *command,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                # its own process group: a Ctrl-C reaches it once, through the agent
                start_new_session=True,
            )
        except OSError as err:
            code = 127 if isinstance(err, FileNotFoundError) else 126
            log.error("cannot start the worker %s: %s", command, err, extra={"drone": self._drone})
            return await self._give_up(code, f"cannot start the worker: {err}")
        self._worker = worker
        if self.lifecycle.state is S.STARTING:  # else a signal came while it started
            self.lifecycle.move(S.WORKER_UP)
        self._emit(WorkerStarted, pid=worker.pid, command=bounded_command(command))
        if self._stop_signal is not None:
            worker.send_signal(self._stop_signal)
        if self.startd is not None:
            self._spawn(self._observe(), "observe")
        else:
            self._claimable.set()
        returncode = await worker.wait()
        return await self._wind_down(worker.pid, returncode)

    async def _give_up(self, code: int, reason: str) -> int:
        self._winding_down = True
        self._seal_gate()
        self.lifecycle.move(S.EXITING)
        self._emit(AgentExiting, exit_code=code, reason=reason)
        self._emit(Heartbeat, interval_s=self.settings.heartbeat_s)
        return code

    async def _wind_down(self, pid: int, returncode: int) -> int:
        """The worker has ended: publish the last facts, ending with a heartbeat"""
        self._winding_down = True
        await self._cancel_background()
        status = exit_status(returncode)
        log.info("worker %d exited with %d", pid, status, extra={"drone": self._drone})
        self._emit(
            WorkerExited,
            pid=pid,
            exit_code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
        )
        payloads_left = bool(self._payloads)
        for job_id in list(self._payloads):
            self._finish_payload(job_id, PayloadEnd.UNKNOWN, None, None)
        if self._seal_gate():
            self._emit(GateClosed, reason="the worker exited")
        if self.lifecycle.state is S.DRAINING:
            self.lifecycle.move(S.DRAINED)
            self._emit(Drained)
            if self._ending is None and not payloads_left and status in SELF_EXIT_STATUSES:
                # the startd finished the drain (exit on completion) and the master
                # followed before the drain flow had confirmed it: the planned end
                self._ending = "drained"
        if self._ending is not None and (self._terminated or status in SELF_EXIT_STATUSES):
            # the drone ended its own job as planned (drained or released)
            code, reason = 0, self._ending
        elif self._ending is not None:
            code, reason = status, self._ending
        elif self._stop_signal is not None:
            code, reason = status, f"{signal.Signals(self._stop_signal).name} from the batch system"
        else:
            code, reason = status, "the worker exited"
        if self._claimed and not self._released:
            # nothing runs and the gate is shut for good: let the record say so
            await self._kv_finish(RecordPhase.DRAINED, f"agent exiting: {reason}", budget_s=3.0)
        if self.lifecycle.state is not S.EXITING:
            self.lifecycle.move(S.EXITING)
        self._emit(AgentExiting, exit_code=code, reason=reason)
        self._emit(Heartbeat, interval_s=self.settings.heartbeat_s)
        return code

    # ================================================================== tasks

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tg is None or self._winding_down:
            coro.close()
            return
        guarded = self._guard(coro, name)
        try:
            task = self._tg.create_task(guarded, name=name)
        except RuntimeError:  # the task group is already shutting down: nothing new starts
            guarded.close()
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        # a bug in one activity must not take the worker (and its payloads) down
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("%s failed", name, extra={"drone": self._drone})

    async def _cancel_background(self) -> None:
        await stop_tasks(t for t in self._tasks if t is not asyncio.current_task())

    async def _heartbeats(self) -> None:
        interval = self.settings.heartbeat_s
        while not self._winding_down:
            await asyncio.sleep(interval)
            self._emit(Heartbeat, interval_s=interval)
            self._recheck.set()  # backstop: re-read the record even if no hint arrived

    # ================================================================== events

    def _emit(self, kind: type[E], **fields: Any) -> E:
        """Record an event with the snapshot after it, and queue it for publishing"""
        assert self._spool is not None and self._publisher is not None
        for name, value in fields.items():
            if isinstance(value, str) and len(value) > MAX_TEXT:
                self.counters["strings_cut"] += 1
                fields[name] = _cut(value, MAX_TEXT)
        self._seq += 1
        seq = self._seq
        event_id = dedupe_id(self._drone, self.incarnation, seq)
        event = kind(
            site=self._site,
            drone=self._drone,
            incarnation=self.incarnation,
            seq=seq,
            at=utcnow(),
            id=event_id,
            snapshot=self.snapshot(),
            **fields,
        )
        tag = kind_of(kind)
        self._spool.append(
            SpooledEvent(
                id=event_id,
                seq=seq,
                kind=tag,
                subject=self.namespace.event(self._site, self._drone, tag),
                data=encode(event),
            )
        )
        self._publisher.wake()
        log.log(
            logging.DEBUG if tag == "heartbeat" else logging.INFO,
            "%s (state %s)",
            tag,
            self.lifecycle.state,
            extra={"drone": self._drone, "seq": seq, "event": tag},
        )
        return event

    # ================================================================== the gate

    def prepare_job(self, job: JobStart) -> GateDecision:
        """
        PREPARE_JOB: allow the payload (and publish it) if the gate is open

        Synchronous on purpose (see :mod:`remote_agent.interfaces`): between the
        check and the record nothing else runs, and a drain closes the gate in
        one step too, so no payload is allowed after a drain was accepted. A
        payload beyond the drone's slots, or with a job id longer than
        :data:`MAX_JOB_ID`, is refused too: the snapshot stays bounded.
        """
        if not self._gate_open:
            return self._refuse(job, self._closed_reason(), "payloads_refused", log_level=None)
        if job.job_id in self._payloads:
            return GateDecision(allow=True, message="already running")
        if len(job.job_id) > MAX_JOB_ID:
            reason = f"job id longer than {MAX_JOB_ID} characters"
            return self._refuse(job, reason, "payloads_refused_job_id")
        capacity = self.capacity
        if len(self._payloads) >= capacity:
            reason = f"all {capacity} slot(s) of the drone run payloads already"
            return self._refuse(job, reason, "payloads_refused_over_slots")
        slot = job.slot
        if len(slot) > MAX_NAME:
            self.counters["strings_cut"] += 1
            slot = _cut(slot, MAX_NAME)
        self._payloads[job.job_id] = Payload(job_id=job.job_id, slot=slot, started_at=utcnow())
        self._admitted += 1
        self._payloads_changed()
        self.counters["payloads_allowed"] += 1
        self._emit(PayloadStarted, job_id=job.job_id, slot=slot)
        return GateDecision(allow=True)

    @property
    def capacity(self) -> int:
        """How many payloads the gate lets run at once: the slots, at most :data:`MAX_PAYLOADS`"""
        return min(self._slots, MAX_PAYLOADS) if self._slots > 0 else MAX_PAYLOADS

    def _refuse(
        self, job: JobStart, reason: str, counter: str, log_level: int | None = logging.WARNING
    ) -> GateDecision:
        self._remember(self._refused, job.job_id)
        self.counters["payloads_refused"] += 1
        extra = {"drone": self._drone, "job_id": job.job_id[:MAX_JOB_ID]}
        if log_level is None:
            log.info("refused payload %s: %s", job.job_id, reason, extra=extra)
        else:
            self.counters[counter] += 1
            _rejections.log(
                log_level, counter, "refused payload %r: %s", job.job_id, reason, extra=extra
            )
        return GateDecision(allow=False, status_code=GATE_CLOSED_STATUS, message=reason)

    @staticmethod
    def _remember(table: dict[str, float], job_id: str) -> None:
        table.pop(job_id, None)
        table[job_id] = time.monotonic()
        while len(table) > _MAX_REMEMBERED:
            del table[next(iter(table))]

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        """
        JOB_EXIT: the payload ended; publish it

        Only a hint: the payload leaves the snapshot, but the drone is idle only
        when the startd lists nothing (:meth:`_confirm_idle`, release-if-idle).
        """
        if job_id not in self._payloads:
            if job_id in self._finished or job_id in self._refused:
                log.debug("job exit of %s: known already", job_id, extra={"drone": self._drone})
                return
            self.counters["job_exit_unknown"] += 1
            _rejections.warning(
                "job_exit_unknown",
                "job exit of %r, which the gate never saw; ignored",
                job_id,
                extra={"drone": self._drone},
            )
            self._remember(self._finished, job_id)
            return
        self._finish_payload(job_id, how, exit_code, duration_s)

    def _finish_payload(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        payload = self._payloads.pop(job_id, None)
        self._missing.pop(job_id, None)
        self._remember(self._finished, job_id)
        if duration_s is None and payload is not None:
            duration_s = (utcnow() - payload.started_at).total_seconds()
        if duration_s is not None and duration_s < 0:
            duration_s = None
        self._payloads_changed()
        self._emit(
            PayloadFinished,
            job_id=job_id,
            slot=payload.slot if payload is not None else "",
            how=how,
            exit_code=exit_code,
            duration_s=duration_s,
        )

    def _payloads_changed(self) -> None:
        if self._payloads:
            self._payloads_done.clear()
        else:
            self._payloads_done.set()
        state = self.lifecycle.state
        if state is S.IDLE and self._payloads:
            self.lifecycle.move(S.BUSY)
        elif state is S.BUSY and not self._payloads:
            self.lifecycle.move(S.IDLE)

    def _closed_reason(self) -> str:
        state = self.lifecycle.state
        if self._released:
            return "the drone was released by its manager"
        if self._drain is not None:
            return f"the drone is draining ({self._drain.reason or 'no reason given'})"
        if state is S.DRAINED:
            return "the drone is drained and ending its job"
        if state is S.EXITING:
            return "the drone's agent is exiting"
        if not self._claimed:
            return "the gate is not open yet: waiting for the handshake with the manager"
        return "the gate is closed"

    def _open_gate(self) -> None:
        self._gate_open = True
        self.lifecycle.move(S.BUSY if self._payloads else S.IDLE)
        self._emit(GateOpened, reason="handshake record claimed")
        self._sync_accepting()

    def _seal_gate(self) -> bool:
        """Shut the gate for good; ``True`` if it was open"""
        self._sealed = True
        was_open, self._gate_open = self._gate_open, False
        if was_open:
            self._sync_accepting()
        return was_open

    # ================================================================== handshake record

    async def _record_store(self) -> RecordStore:
        """The handshake bucket, once connected"""
        assert self._publisher is not None
        await self._publisher.connected.wait()
        if self._store is None:
            js = self._publisher.js
            assert js is not None
            bucket = self.namespace.record_bucket
            # bound without STREAM.INFO: a drone needs only a direct get and publishes
            # to its own key, no other JetStream API (docs/agent.md, permissions)
            kv = KeyValue(
                name=bucket, stream=kv_stream(bucket), pre=kv_subjects(bucket), js=js, direct=True
            )
            self._store = RecordStore(kv, self.namespace, js=js, domain=self._domain)
        return self._store

    async def _kv(
        self, what: str, op: Callable[[RecordStore], Awaitable[Versioned]], budget_s: float = 30.0
    ) -> Versioned | None:
        """Run a record operation, retrying while the broker is away, for ``budget_s``"""
        deadline = time.monotonic() + budget_s
        backoff = Backoff(first=0.1, most=2.0)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("gave up to %s for now", what, extra={"drone": self._drone})
                return None
            try:
                store = await asyncio.wait_for(self._record_store(), remaining)
                return await asyncio.wait_for(op(store), remaining)
            except HandshakeError as err:
                log.warning("cannot %s: %s", what, err, extra={"drone": self._drone})
                return None
            except (nats.errors.Error, OSError, TimeoutError) as err:
                log.debug("cannot %s yet: %r", what, err, extra={"drone": self._drone})
            await asyncio.sleep(min(backoff.delay(), max(0.0, deadline - time.monotonic())))

    async def _kv_finish(self, phase: RecordPhase, note: str, budget_s: float = 30.0) -> None:
        if self._released or self._record_lost is not None:
            return
        assert phase in (RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED)
        site, drone, incarnation = self._site, self._drone, self.incarnation
        await self._kv(
            f"record {phase}",
            lambda store: store.finish(site, drone, incarnation, phase, note),
            budget_s,
        )

    async def _claim(self) -> None:
        """Claim the record before the gate may open; act on what it says"""
        await self._claimable.wait()
        # subscribed first: every write to the record after the claim's read is a hint
        await self._listening.wait()
        backoff = Backoff(first=0.2, most=5.0)
        failures = 0
        while not self._sealed:
            store = await self._record_store()
            try:
                versioned = await store.claim(self._site, self._drone, self.incarnation)
            except (HandshakeError, nats.errors.Error, OSError, TimeoutError) as err:
                failures += 1
                log.log(
                    logging.WARNING if failures in (1, 10) else logging.DEBUG,
                    "cannot claim the handshake record yet (bucket %s provisioned?): %r",
                    self.namespace.record_bucket,
                    err,
                    extra={"drone": self._drone},
                )
                await asyncio.sleep(backoff.delay())
                continue
            self._apply_claim(versioned.record)
            return

    def _apply_claim(self, record: DroneRecord) -> None:
        phase = record.phase
        if phase is RecordPhase.UP and record.incarnation == self.incarnation:
            self._claimed = True
            if self._sealed:
                log.info("claimed, but the gate is shut already", extra={"drone": self._drone})
                return
            self._open_gate()
        elif phase is RecordPhase.RELEASED:
            self._on_released(record)
        elif phase in CLOSED_PHASES:  # not released (above): told to drain
            # an earlier incarnation was told to drain: carry on with that intent
            self._claimed = True
            self._claimed_incarnation = record.incarnation
            intent = record.drain or DrainIntent(
                deadline=utcnow(),
                reason=record.note or f"handshake record is {phase}",
                requested_at=record.at,
            )
            self._accept_drain(self._record_intent(intent), write_intent=False)
        else:
            log.error("unexpected claim result %s", record, extra={"drone": self._drone})

    def _on_released(self, record: DroneRecord) -> None:
        if self._released:
            return
        self._released = True
        self._seal_gate()
        if self.lifecycle.state is not S.EXITING:
            self.lifecycle.move(S.RELEASED)
        reason = record.note or "released by the manager before the agent came up"
        self._emit(Released, reason=reason)
        log.warning("drone released: %s; ending the job", reason, extra={"drone": self._drone})
        self._spawn(self._end_job("released"), "end-job")

    async def _watch_record(self) -> None:
        """Re-read the record on every hint, reconnect and heartbeat, and act on it"""
        while not self._winding_down:
            await self._recheck.wait()
            self._recheck.clear()
            if not self._claimed or self._released or self._record_lost is not None:
                continue
            try:
                store = await self._record_store()
                current = await store.read(self._site, self._drone)
            except HandshakeError as err:  # a value that is no valid record
                self._on_record_lost(f"the record does not decode ({err})")
                continue
            except (nats.errors.Error, OSError, TimeoutError) as err:
                log.debug("cannot read the record: %r", err, extra={"drone": self._drone})
                await asyncio.sleep(self.settings.reconnect_wait_s)
                self._recheck.set()  # the hint is not lost with the failed read
                continue
            if current is None:
                self._on_record_lost("the record was deleted")
            else:
                self._apply_record(current.record)

    def _apply_record(self, record: DroneRecord) -> None:
        """Act on the record as read while the agent is up (claimed)"""
        phase = record.phase
        if phase is RecordPhase.RELEASED:
            self._on_record_lost(f"the record says released (writer {record.writer})")
        elif record.incarnation not in (self.incarnation, self._claimed_incarnation):
            self._on_record_lost(
                f"the record says {phase} for another incarnation ({record.incarnation!r})"
            )
        elif phase is RecordPhase.DRAINING and record.drain is not None:
            if self._drain is None:
                log.info("the record asks for a drain", extra={"drone": self._drone})
                self._accept_drain(self._record_intent(record.drain), write_intent=False)
        elif (
            phase is not RecordPhase.UP
            and self._drain is None
            and self.lifecycle.state not in (S.DRAINED, S.EXITING)
        ):
            log.warning(
                "the record says %s although no drain was accepted; draining",
                phase,
                extra={"drone": self._drone},
            )
            self._self_drain(f"handshake record is {phase}")

    def _on_record_lost(self, why: str) -> None:
        """
        The record no longer says that this agent is up: shut the gate at once, then drain

        Payloads keep running; the drain waits for them (until the self-drain
        deadline, ``--self-drain-deadline``) and ends the job as a drain does.
        The agent never writes the record again: it is not the agent's any more.
        """
        if self._record_lost is not None:
            return
        self._record_lost = why
        self.counters["record_lost"] += 1
        was_open = self._seal_gate()
        log.warning(
            "handshake record lost while up: %s; gate closed, draining",
            why,
            extra={"drone": self._drone},
        )
        if was_open:
            self._emit(GateClosed, reason=f"record lost: {why}")
        if self._drain is None and self.lifecycle.state not in (S.DRAINED, S.EXITING):
            self._self_drain(f"record lost: {why}")

    def _record_intent(self, intent: DrainIntent) -> DrainIntent:
        """
        A drain intent read from the record, with a deadline no sooner than a self-drain's

        The record's value may not be the manager's: the server stores on a
        record's subject what other drones make it send there (a reply subject
        is not checked against permissions), and the agent cannot check the
        manager's proof. A deadline, which ends in ``deadline_expired`` and so
        in the drone's removal, counts at once only when it comes as a command,
        which only the manager can send.
        """
        earliest = utcnow() + dt.timedelta(seconds=self.settings.self_drain_deadline_s)
        if intent.deadline >= earliest:
            return bounded_intent(intent)
        return bounded_intent(msgspec.structs.replace(intent, deadline=earliest))

    def _self_drain(self, reason: str) -> None:
        now = utcnow()
        deadline = now + dt.timedelta(seconds=self.settings.self_drain_deadline_s)
        intent = DrainIntent(deadline=deadline, reason=reason, requested_at=now)
        self._accept_drain(intent, write_intent=False)

    async def _serve(self) -> None:
        """Subscribe to the command subject and to writes of the own record"""
        assert self._publisher is not None
        await self._publisher.connected.wait()
        nc = self._publisher.nc
        assert nc is not None
        await nc.subscribe(self.namespace.command(self._site, self._drone), cb=self._on_command)
        # A core subscription on the key's subject sees every write attempt, also ones the
        # stream refused, so it is only a hint to re-read the record; the client replays
        # it after a reconnect. (A KV watch would need the consumer API.)
        subject = self.namespace.record_subject(self._site, self._drone)
        await nc.subscribe(subject, cb=self._on_record_hint)
        while True:  # the server has the subscriptions once a flush returns
            try:
                await nc.flush()
                break
            except (nats.errors.Error, TimeoutError) as err:
                log.debug("subscriptions not flushed yet: %r", err, extra={"drone": self._drone})
                await asyncio.sleep(self.settings.reconnect_wait_s)
        self._listening.set()

    async def _on_record_hint(self, msg: Msg) -> None:
        self._recheck.set()

    # ================================================================== commands

    async def _on_command(self, msg: Msg) -> None:
        try:
            await self._command(msg)
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("command handling failed", extra={"drone": self._drone})

    async def _command(self, msg: Msg) -> None:
        if not msg.reply:
            self.counters["command_errors"] += 1
            log.warning("a command without reply subject; ignored", extra={"drone": self._drone})
            return
        try:
            command = decode_command(msg.data)
        except SchemaError as err:
            await self._reject(msg.reply, str(err), "")
            return
        if (command.site, command.drone) != (self._site, self._drone):
            await self._reject(
                msg.reply,
                f"command for {command.site}/{command.drone} reached the agent of "
                f"{self._site}/{self._drone}",
                command.request_id,
            )
            return
        if isinstance(command, ReleaseIfIdleCommand):
            outcome, detail = await self._release_if_idle()
        else:
            outcome, detail = self._execute(command)
        self.counters["commands"] += 1
        log.info(
            "%s %s: %s (%s)",
            kind_of(type(command)),
            command.request_id,
            outcome,
            detail,
            extra={"drone": self._drone, "request_id": command.request_id},
        )
        recorded = self._release_recorded
        if outcome is Outcome.RELEASED and recorded is not None:
            # let the record say "drained" before the manager hears "released", if quick
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(recorded.wait(), _REPLY_RECORD_WAIT_S)
        reply = Reply(
            site=self._site,
            drone=self._drone,
            request_id=_cut(command.request_id, MAX_REQUEST_ID),
            outcome=outcome,
            detail=_cut(detail, MAX_TEXT),
            snapshot=self.snapshot(),
        )
        await self._send_reply(msg.reply, encode(reply))

    async def _reject(self, reply_to: str, error: str, request_id: str) -> None:
        self.counters["command_errors"] += 1
        log.warning("rejected a command: %s", error, extra={"drone": self._drone})
        reply = ErrorReply(error=_cut(error, MAX_TEXT), request_id=_cut(request_id, MAX_REQUEST_ID))
        await self._send_reply(reply_to, encode(reply))

    async def _send_reply(self, reply_to: str, data: bytes) -> None:
        assert self._publisher is not None
        nc = self._publisher.nc
        if nc is None:
            return
        try:
            # not msg.respond(): that would echo the request's headers
            # (nats.py nats/aio/msg.py: respond publishes with headers=self.headers)
            await nc.publish(reply_to, data)
        except (nats.errors.Error, OSError) as err:
            log.warning("cannot send a reply: %r", err, extra={"drone": self._drone})

    def _execute(self, command: DrainCommand | StatusCommand) -> tuple[Outcome, str]:
        """Carry out a command at once (no await), so it is ordered with the gate"""
        if isinstance(command, DrainCommand):
            intent = DrainIntent(
                deadline=command.deadline,
                reason=command.reason,
                request_id=command.request_id,
                requested_at=command.at,
            )
            return self._accept_drain(bounded_intent(intent), write_intent=True)
        assert isinstance(command, StatusCommand)
        return Outcome.STATUS, f"{self.lifecycle.state}, {len(self._payloads)} payload(s)"

    def _accept_drain(self, intent: DrainIntent, *, write_intent: bool) -> tuple[Outcome, str]:
        """
        Close the gate for ``intent`` and start draining; idempotent

        :param write_intent: record the intent in the handshake record (a drain
            that came as a command; one read from the record is there already)
        """
        state = self.lifecycle.state
        if self._released:
            reason = "the drone was released before its agent came up; it is ending"
            self._emit(DrainRefused, request_id=intent.request_id, reason=reason)
            return Outcome.REFUSED, reason
        if self._drain is not None:
            if state is S.DRAINED:
                return Outcome.DRAINED, "drained; the drone is ending its job"
            if intent.request_id and intent.request_id == self._drain.request_id:
                return Outcome.DRAIN_ACCEPTED, self._drain_detail()
            return Outcome.ALREADY_DRAINING, (
                f"draining for request {self._drain.request_id!r} until "
                f"{self._drain.deadline.isoformat()}; {self._drain_detail()}"
            )
        if state is S.DRAINED:
            return Outcome.DRAINED, "drained; the drone is ending its job"
        if state is S.EXITING:
            reason = "the agent is exiting"
            self._emit(DrainRefused, request_id=intent.request_id, reason=reason)
            return Outcome.REFUSED, reason
        intent = bounded_intent(intent)
        self._drain = intent
        was_open = self._seal_gate()
        self.lifecycle.move(S.DRAINING)
        count = len(self._payloads)
        self._emit(DrainRequested, intent=intent)
        self._emit(DrainAccepted, intent=intent, payloads=count)
        if was_open:
            self._emit(GateClosed, reason=f"drain: {intent.reason}" if intent.reason else "drain")
        if count:
            self._emit(Draining, payloads=count, deadline=intent.deadline)
        self._spawn(self._drain_flow(intent, write_intent), "drain")
        return Outcome.DRAIN_ACCEPTED, self._drain_detail()

    def _drain_detail(self) -> str:
        count = len(self._payloads)
        if not count:
            return "gate closed; no payload running, the drone is ending its job"
        deadline = self._drain.deadline.isoformat() if self._drain else "?"
        return f"gate closed; {count} payload(s) still running, deadline {deadline}"

    def _release_known(self) -> tuple[Outcome, str] | None:
        """The answer to release-if-idle that needs no look at the startd, if any"""
        if self._released:
            return Outcome.RELEASED, "released by the manager before the agent came up"
        if self._payloads:
            return Outcome.BUSY, f"{len(self._payloads)} payload(s) running; nothing changed"
        if self.lifecycle.state is S.DRAINED:
            # the drained state required the startd's word already
            return Outcome.RELEASED, "idle, gate closed; the drone is ending its job"
        return None

    async def _release_if_idle(self) -> tuple[Outcome, str]:
        """
        Release the drone only if the startd, not just the hooks, says nothing runs

        Serialized with payload starts: the admission count is remembered, the
        startd asked, and then in one synchronous step the drone is refused
        (BUSY) if anything was admitted meanwhile or the startd lists anything
        busy, else the gate is sealed.
        """
        known = self._release_known()
        if known is not None:
            return known
        admitted = self._admitted
        busy = await self._startd_busy()
        # ---- from here to the return nothing awaits
        known = self._release_known()
        if known is not None:
            return known
        if self._admitted != admitted:
            return Outcome.BUSY, "a payload started meanwhile; nothing changed"
        if busy is None:
            return Outcome.BUSY, "the startd does not answer and the worker runs; nothing changed"
        if busy:
            listed = ", ".join(
                f"{slot.name} {slot.state}/{slot.activity} {slot.job_id or '-'}"
                for slot in busy[:8]
            )
            return Outcome.BUSY, _cut(
                f"the startd lists {len(busy)} busy slot(s): {listed}; nothing changed", MAX_TEXT
            )
        state = self.lifecycle.state
        if self._drain is not None or self._ending is not None:
            return Outcome.RELEASED, "idle, gate closed; the drone is ending its job"
        if state is S.EXITING:
            return Outcome.RELEASED, "idle; the agent is exiting"
        was_open = self._seal_gate()
        self.lifecycle.move(S.DRAINED)
        if was_open:
            self._emit(GateClosed, reason="release if idle")
        self._emit(Drained)
        self._release_recorded = asyncio.Event()
        self._spawn(self._end_after_release(self._release_recorded), "release")
        return Outcome.RELEASED, "idle; gate closed, the drone is ending its job"

    async def _end_after_release(self, recorded: asyncio.Event) -> None:
        await self._kv_finish(RecordPhase.DRAINED, "released while idle")
        recorded.set()
        await self._stop_startd("released while idle")
        await self._end_job("released while idle")

    # ================================================================== drain

    async def _drain_flow(self, intent: DrainIntent, write_intent: bool) -> None:
        site, drone = self._site, self._drone
        if write_intent:
            await self._kv(
                "record the drain intent",
                lambda store: store.request_drain(site, drone, intent, writer="agent"),
            )
        await self._stop_startd(intent.reason)
        expired = False
        while True:
            if not expired:
                await self._wait_payloads(intent.deadline)
            else:
                await self._payloads_done.wait()
            if await self._confirm_idle():
                break
            if not expired and utcnow() >= intent.deadline:
                expired = True
                await self._deadline_expired(intent)
            # the snapshot may be empty (a JOB_EXIT, forged or early) while the startd
            # still lists jobs or claims: look again after a poll interval
            await asyncio.sleep(self.settings.poll_s)
        await self._kv_finish(RecordPhase.DRAINED, intent.reason)
        if self.lifecycle.state is S.DRAINING:
            self.lifecycle.move(S.DRAINED)
            self._emit(Drained)
        await self._end_job("drained")

    async def _deadline_expired(self, intent: DrainIntent) -> None:
        count, policy = max(len(self._payloads), self._busy_slots), self.settings.deadline_policy
        log.warning(
            "drain deadline passed with %d payload(s) running; policy %s",
            count,
            policy,
            extra={"drone": self._drone},
        )
        self._emit(DrainDeadlineExpired, payloads=count, action=policy)
        await self._kv_finish(
            RecordPhase.DEADLINE_EXPIRED, f"{count} payload(s) running at the deadline"
        )
        if policy == "kill":
            self._ending = "drain deadline expired"
            await self._kill_payloads(intent.reason)

    async def _wait_payloads(self, deadline: dt.datetime) -> bool:
        """Wait for the last payload to end, until ``deadline``; ``True`` if none runs"""
        remaining = (deadline - utcnow()).total_seconds()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._payloads_done.wait(), max(remaining, 0.0))
        return not self._payloads

    async def _kill_payloads(self, reason: str) -> None:
        if self.startd is not None:
            await self._startd_drain(reason, fast=True)
        else:
            # without a startd the payloads are the worker's business: end the worker
            await self._terminate_worker()

    # ================================================================== startd

    async def _observe(self) -> None:
        """Poll the startd: readiness first, then its slots as a backstop to the hooks"""
        assert self.startd is not None
        failures = polls = 0
        # after the startd came up, ask for readiness now and then too: that is where
        # CondorStartd notices a restarted startd and sets the gate attribute again
        ready_every = max(1, round(_READY_CHECK_S / self.settings.poll_s))
        while not self._winding_down:
            try:
                if not self._startd_ready:
                    if await self.startd.ready():
                        self._on_startd_ready(await self.startd.slots())
                else:
                    polls += 1
                    if polls % ready_every == 0:
                        await self.startd.ready()
                    self._reconcile_slots(await self.startd.slots())
                failures = 0
            except StartdError as err:
                failures += 1
                log.log(
                    logging.WARNING if failures == 3 else logging.DEBUG,
                    "the startd does not answer: %s",
                    err,
                    extra={"drone": self._drone},
                )
            await asyncio.sleep(self.settings.poll_s)

    def _on_startd_ready(self, slots: list[SlotInfo]) -> None:
        self._startd_ready = True
        self._slots = max(len(slots), self.settings.slots)
        if self.lifecycle.state is S.WORKER_UP:
            self.lifecycle.move(S.STARTD_READY)
        name = slots[0].name if slots else socket.gethostname()
        self._emit(StartdReady, slots=self._slots, name=_cut(name, MAX_NAME))
        # The gate has never been open in this incarnation (the claim waits for this
        # moment), so whatever runs now was let in before: an agent that was restarted.
        for job_id, slot in self._unknown_jobs(slots).items():
            self._adopt(job_id, slot, "was running when the agent started")
        self._claimable.set()

    def _unknown_jobs(self, slots: list[SlotInfo]) -> dict[str, str]:
        """Jobs running in ``slots`` that are no payload of ours, by id, with their slot"""
        return {
            slot.job_id: slot.name
            for slot in slots
            if slot.job_id
            and slot.job_id not in self._payloads
            and slot.job_id not in self._refused  # refused: listed until its starter exits
            and slot.job_id not in self._finished  # JOB_EXIT runs before output transfer
        }

    def _adopt(self, job_id: str, slot: str, why: str) -> None:
        """Count a payload that runs although the gate never let it in"""
        if len(job_id) > MAX_JOB_ID or len(self._payloads) >= MAX_PAYLOADS:
            # not in the snapshot, but the startd lists it: the drone is not idle
            self.counters["payloads_not_listed"] += 1
            return
        slot = _cut(slot, MAX_NAME)
        self._admitted += 1
        log.warning(
            "payload %s never passed the gate but runs (%s); counting it",
            job_id,
            why,
            extra={"drone": self._drone, "job_id": job_id},
        )
        self._payloads[job_id] = Payload(job_id=job_id, slot=slot, started_at=utcnow())
        self._payloads_changed()
        self._emit(PayloadStarted, job_id=job_id, slot=slot)

    def _reconcile_slots(self, slots: list[SlotInfo]) -> None:
        """Finish payloads that vanished without a JOB_EXIT; adopt ones the gate never saw"""
        now = time.monotonic()
        for table in (self._refused, self._finished):
            for job_id in [j for j, at in table.items() if now - at > _FORGET_S]:
                del table[job_id]
        self._slots = max(len(slots), self.settings.slots)
        running = {slot.job_id for slot in slots if slot.job_id}
        for job_id, payload in list(self._payloads.items()):
            if job_id in running:
                self._missing.pop(job_id, None)
                continue
            if (utcnow() - payload.started_at).total_seconds() < self.settings.poll_s:
                continue  # too young to be listed yet
            self._missing[job_id] = misses = self._missing.get(job_id, 0) + 1
            if misses >= 2:
                log.warning(
                    "payload %s vanished without a JOB_EXIT hook",
                    job_id,
                    extra={"drone": self._drone, "job_id": job_id},
                )
                self._finish_payload(job_id, PayloadEnd.UNKNOWN, None, None)
        unknown = self._unknown_jobs(slots)
        for job_id in sorted(unknown.keys() & self._unknown_seen):
            # listed in two polls in a row: the hooks are not configured, or an earlier
            # agent let it in; either way it runs, so it counts
            self._adopt(job_id, unknown[job_id], "seen in two polls")
        self._unknown_seen = set(unknown) - set(self._payloads)

    def _worker_ended(self) -> bool:
        """Whether the worker has exited: then everything that ran under it has ended"""
        worker = self._worker
        return worker is not None and worker.returncode is not None

    async def _startd_busy(self) -> list[SlotInfo] | None:
        """
        The slots the startd reports busy (claimed, or running a job); ``None``: unknown

        The startd is the authority on "idle", the hooks only a hint. A startd
        that does not answer while the worker runs is *not* idle (``None``); an
        exited worker took its startd and payloads with it (``[]``).
        """
        if self.startd is None:
            return []
        try:
            slots = await self.startd.slots()
        except StartdError as err:
            if self._worker_ended():
                return []
            _rejections.log(
                logging.INFO,
                "startd_unanswered",
                "the startd does not answer (%s); not calling the drone idle",
                err,
                extra={"drone": self._drone},
            )
            return None
        busy = [slot for slot in slots if slot.busy]
        for job_id, slot_name in self._unknown_jobs(slots).items():
            self._adopt(job_id, slot_name, "still listed by the startd")
        return busy

    async def _confirm_idle(self) -> bool:
        """
        Before saying "drained": nothing in the snapshot, and the startd lists nothing busy

        A startd that does not answer any more while the worker runs may be
        hanging: not idle. Once the worker has exited (drain with exit on
        completion), its payloads have ended with it.
        """
        busy = await self._startd_busy()
        self._busy_slots = -1 if busy is None else len(busy)
        return busy is not None and not busy and not self._payloads

    def _sync_accepting(self) -> None:
        """Make the startd's START attribute follow the gate (in order, last wins)"""
        if self.startd is not None:
            self._spawn(self._apply_accepting(), "startd-accepting")

    async def _apply_accepting(self) -> None:
        assert self.startd is not None
        async with self._accepting_lock:
            wanted = self._gate_open
            if wanted == self._accepting:
                return
            try:
                await self.startd.set_accepting(wanted)
            except StartdError as err:
                log.warning(
                    "cannot set the startd's START attribute to %s: %s; the gate hook "
                    "still refuses payloads",
                    wanted,
                    err,
                    extra={"drone": self._drone},
                )
                return
            self._accepting = wanted

    async def _stop_startd(self, reason: str) -> None:
        """No new claims, and drain the startd gracefully so it exits on completion"""
        if self.startd is None:
            return
        await self._apply_accepting()
        await self._startd_drain(reason, fast=False)

    async def _startd_drain(self, reason: str, *, fast: bool) -> None:
        assert self.startd is not None
        try:
            result = await self.startd.drain(reason or "cobald-remote drain", fast=fast)
        except StartdError as err:
            log.warning("condor_drain failed: %s", err, extra={"drone": self._drone})
            return
        if not result.accepted:
            log.warning("condor_drain refused: %s", result.detail, extra={"drone": self._drone})

    # ================================================================== worker

    async def _end_job(self, reason: str) -> None:
        """End the drone's batch job: the worker ends by itself or is terminated"""
        self._ending = reason
        worker = self._worker
        if worker is None or worker.returncode is not None:
            return
        if self.startd is not None and reason != "released":
            # the startd drained with -exit-on-completion; give the worker time to follow
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.wait(), self.settings.end_grace_s)
        if worker.returncode is None:
            log.info("ending the worker (%s)", reason, extra={"drone": self._drone})
            await self._terminate_worker()

    async def _terminate_worker(self) -> None:
        """SIGTERM, then SIGKILL to its process group after ``kill_after_s``"""
        worker = self._worker
        if worker is None or worker.returncode is not None:
            return
        self._terminated = True
        with contextlib.suppress(ProcessLookupError):
            worker.terminate()
        try:
            await asyncio.wait_for(worker.wait(), self.settings.kill_after_s)
        except TimeoutError:
            log.warning(
                "worker %d ignored SIGTERM for %.0fs, killing it",
                worker.pid,
                self.settings.kill_after_s,
                extra={"drone": self._drone},
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)

    async def _kill_worker(self) -> None:
        """The agent itself is failing: do not leave the worker behind"""
        worker = self._worker
        if worker is None or worker.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(worker.wait()), 5)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)
