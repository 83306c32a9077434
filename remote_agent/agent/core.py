"""
The drone agent: the composition root of its jobs

One :class:`Agent` runs inside each drone job (``cobald-remote agent run``). It
wires the drone's status (:mod:`~remote_agent.agent.status`) to the jobs that
read and change it: emission, payload bookkeeping, the worker, the tasks, the
startd, the handshake record, the drain and the command server; and it runs
the drone from the worker's start to the agent's last event.
``docs/agent.md`` describes the behaviour for operators; ``docs/handshake.md``
why the release is race-free.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import signal
import socket
import time
import uuid
from collections import Counter
from collections.abc import Mapping

from remote_agent import __version__
from remote_agent.agent.bounds import bounded_command, cut
from remote_agent.agent.commands import CommandServer
from remote_agent.agent.context import AgentContext
from remote_agent.agent.drain import Drain
from remote_agent.agent.emission import Emitter
from remote_agent.agent.identity import BootstrapIdentity, load_or_make_key
from remote_agent.agent.lifetime import NOTICE_SIGNALS, Lifetime
from remote_agent.agent.payloads import PayloadLedger
from remote_agent.agent.record import RecordClient
from remote_agent.agent.startd import StartdObserver
from remote_agent.agent.state import Lifecycle
from remote_agent.agent.status import DroneStatus
from remote_agent.agent.steering import Steering
from remote_agent.agent.tasks import Tasks, stop_tasks
from remote_agent.agent.watch import RecordWatch
from remote_agent.agent.worker import Worker, exit_decision, exit_status
from remote_agent.interfaces import SELF_EXIT_STATUSES, GateDecision, JobStart, Startd
from remote_agent.jobruntime import RUNTIME_ENV, format_attributes
from remote_agent.protocol.events import (
    AgentExiting,
    AgentStarted,
    Drained,
    DroneState,
    GateClosed,
    Heartbeat,
    Payload,
    PayloadEnd,
    RecordPhase,
    Snapshot,
    WorkerExited,
    WorkerStarted,
    utcnow,
)
from remote_agent.protocol.fields import MAX_NAME
from remote_agent.protocol.names import Namespace, inbox_prefix
from remote_agent.publisher import Publisher
from remote_agent.settings import Settings
from remote_agent.spool import Spool

log = logging.getLogger("remote_agent.agent")

S = DroneState


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
        self.namespace = namespace = Namespace(settings.prefix)
        started = time.monotonic()
        #: this run of the agent; a restarted agent has another one
        self.incarnation = incarnation = uuid.uuid4().hex[:12]
        #: things counted for operators: refused payloads, bad commands, ...
        self.counters = counters = Counter[str]()
        #: events left in the spool when :meth:`run` ended (``None`` before that)
        self.unpublished: int | None = None
        #: the drone's lifecycle, gate, flags and payloads
        self.status = status = DroneStatus(settings.slots, utcnow())
        self.emitter = Emitter(settings, namespace, incarnation, status, counters)
        self._tasks = tasks = Tasks(status, counters, settings.drone)
        self._context = context = AgentContext(
            settings, namespace, incarnation, status, counters, self.emitter, tasks
        )
        self._ledger = ledger = PayloadLedger(context)
        # the hooks judge a payload's runtime by the attributes the agent names
        env = {RUNTIME_ENV: format_attributes(settings.runtime_attributes), **(worker_env or {})}
        self._worker = worker = Worker(context, env=env)
        self._claimable = claimable = asyncio.Event()
        self._startd = startd_ = StartdObserver(context, self.startd, ledger, claimable)
        status.on_gate_change(startd_.sync_accepting)
        self._record = record = RecordClient(context)
        steering = Steering(ledger, record, startd_, worker)
        self._drain = drain = Drain(context, steering)
        self._lifetime = lifetime = Lifetime(context, drain, started)
        self._watch = watch = RecordWatch(
            context, steering, drain, claimable=claimable, end_known=lifetime.known
        )
        self._commands = CommandServer(context, steering, drain, watch)

    # ================================================================== queries

    @property
    def state(self) -> DroneState:
        return self.status.state

    @property
    def lifecycle(self) -> Lifecycle:
        return self.status.lifecycle

    @property
    def started_at(self) -> dt.datetime:
        return self.status.started_at

    @property
    def gate_open(self) -> bool:
        return self.status.gate_open

    @property
    def payloads(self) -> list[Payload]:
        return list(self.status.payloads.values())

    @property
    def publisher(self) -> Publisher | None:
        return self.emitter.publisher

    @property
    def worker_env(self) -> dict[str, str]:
        """Extra environment of the worker (e.g. where the gate socket is); set before run()"""
        return self._worker.env

    @property
    def capacity(self) -> int:
        """How many payloads the gate lets run at once: the slots, at most ``MAX_PAYLOADS``"""
        return self._ledger.capacity

    def snapshot(self) -> Snapshot:
        """The drone's whole state as the agent knows it now"""
        return self.status.snapshot()

    # ================================================================== the gate

    def prepare_job(self, job: JobStart) -> GateDecision:
        """
        PREPARE_JOB: allow the payload (and publish it) if the gate is open

        Synchronous on purpose (see :mod:`remote_agent.interfaces`): between the
        check and the record nothing else runs, and a drain closes the gate in
        one step too, so no payload is allowed after a drain was accepted. A
        payload beyond the drone's slots, or with a job id longer than
        ``MAX_JOB_ID``, is refused too: the snapshot stays bounded.
        """
        return self._ledger.prepare_job(job)

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        """
        JOB_EXIT: the payload ended; publish it

        Only a hint: the payload leaves the snapshot, but the drone is idle only
        when the startd lists nothing (the drain's confirmation, release-if-idle).
        """
        self._ledger.job_exited(job_id, how, exit_code, duration_s)

    async def settled(self) -> None:
        """Return once the events recorded so far are on disk (the spool's fsync)"""
        await self.emitter.settled()

    # ================================================================== run

    async def run(self, *, handle_signals: bool = False) -> int:
        """
        Run the drone until its worker has ended; the result is the exit code

        :param handle_signals: take SIGTERM, SIGUSR1 and SIGUSR2 for notices of the
            drone's end and SIGINT for a stop (the command line does; tests call
            :meth:`notice` and :meth:`request_stop` instead)
        :raises SpoolError: if the spool directory cannot be used
        :raises IdentityError: if the drone's own key cannot be made or read
        """
        settings, drone = self.settings, self.settings.drone
        # reading and rewriting the spool is disk I/O: not on the loop the gate serves from
        spool = await Spool.open_in_thread(settings.spool_dir, settings.spool_max_events)
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, *NOTICE_SIGNALS) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(
                sig, self.request_stop if sig is signal.SIGINT else self.notice, sig
            )
        try:
            last = spool.last_seq
            # docs/protocol.md: start above both the spooled seq and the clock in µs
            seq = max(-1 if last is None else last, time.time_ns() // 1000 - 1)
            identity = self._identity()
            publisher = Publisher(
                spool,
                settings.servers,
                name=f"cobald-remote-agent-{drone}",
                creds=settings.creds,
                inbox_prefix=inbox_prefix(drone),
                publish_timeout_s=settings.publish_timeout_s,
                reconnect_wait_s=settings.reconnect_wait_s,
                domain=settings.domain,
                identity=identity,
            )
            self.emitter.attach(spool, publisher, seq)
            publisher.on_connect(self._watch.recheck)
            publisher.on_refused(self._cut_off)
            async with asyncio.TaskGroup() as tg:
                self._tasks.group = tg
                bus = tg.create_task(publisher.run(), name="publisher")
                if identity is not None:
                    self._tasks.spawn(identity.run(publisher.rotate), "identity")
                try:
                    try:
                        code = await self._lifecycle()
                    except BaseException:
                        await self._worker.kill()
                        raise
                    finally:
                        await self._tasks.cancel()
                    if not await publisher.flush(settings.exit_flush_s):
                        log.warning(
                            "exiting with %d events unpublished (%s)",
                            len(spool),
                            f"the broker refused the credentials: {publisher.refused}"
                            if publisher.refused
                            else f"broker unreachable for {settings.exit_flush_s:.0f}s",
                            extra=self._context.extra,
                        )
                finally:
                    # however the agent ends (also cancelled while it flushes its last
                    # events): the task group cancels each task once, and nats-py may
                    # swallow that (see stop_tasks); a publisher that carried on would
                    # keep the group, and so the agent, from ever ending
                    try:
                        await stop_tasks([bus, *self._tasks.running])
                    finally:
                        await publisher.close()
            if publisher.not_ours:  # the drone could not run as itself: its job failed
                code = 1
            log.info("agent exits with %d", code, extra=self._context.extra)
            return code
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            self.unpublished = len(spool)
            spool.close()

    def _identity(self) -> BootstrapIdentity | None:
        """
        The drone's own identity if the job brought a bootstrap token

        :raises IdentityError: if the drone's key cannot be made or read
        """
        settings = self.settings
        if settings.bootstrap_token is None or settings.bootstrap_creds is None:
            return None
        return BootstrapIdentity(
            load_or_make_key(settings.spool_dir),
            site=settings.site,
            drone=settings.drone,
            token=settings.bootstrap_token,
            bootstrap_creds=settings.bootstrap_creds,
            servers=settings.servers,
            namespace=self._context.namespace,
            on_refused=self._cut_off,
        )

    def notice(self, signum: int = signal.SIGTERM) -> None:
        """
        The batch system announces the drone's end (SIGTERM, SIGUSR1, SIGUSR2)

        The end is now plus ``--term-grace`` (SIGTERM) or ``--warning-grace`` (SIGUSR1,
        SIGUSR2) at the latest: the gate shuts at once,
        payloads that end in time finish, the rest are vacated, and the worker ends
        before the batch system kills it. Before the worker runs, a notice stops the
        agent as :meth:`request_stop` does.
        """
        status = self.status
        if status.state is S.STARTING:
            self.request_stop(signum)
        elif status.winding_down or status.state is S.EXITING:
            log.info(
                "received %s while ending; nothing more to do",
                signal.Signals(signum).name,
                extra=self._context.extra,
            )
        else:
            self._lifetime.notice(signum)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """
        Stop at once: close the gate, pass ``signum`` on to the worker (the command line
        does this for SIGINT)

        The agent exits once the worker has ended, with the worker's status.
        """
        name = signal.Signals(signum).name
        log.info("received %s, forwarding it to the worker", name, extra=self._context.extra)
        self.status.stop_signal = signum
        was_open = self.status.seal_gate()
        self.status.exiting()
        if was_open:
            self.emitter.emit(GateClosed, reason=f"the agent received {name}")
        self._worker.forward(signum)

    def _cut_off(self, reason: str) -> None:
        """
        The broker refused the credentials and closed the connection: shut the gate, drain

        The agent never gets back on the bus, so it can neither tell the manager of a
        payload nor hear a release: no payload may start, the running ones end.
        """
        status = self.status
        if status.seal_gate():
            self.emitter.emit(GateClosed, reason=f"credentials refused: {reason}")
        if (
            status.drain is None
            and not (status.winding_down or status.released)
            and (status.state is not S.EXITING)
        ):
            self._drain.self_drain(f"credentials refused: {reason}")

    async def _lifecycle(self) -> int:
        settings, status, emit, spawn = (
            self.settings,
            self.status,
            self.emitter.emit,
            self._tasks.spawn,
        )
        command = list(settings.worker_command)
        emit(
            AgentStarted,
            agent_version=__version__,
            hostname=cut(socket.gethostname(), MAX_NAME),
            pid=os.getpid(),
            worker_command=bounded_command(command),
        )
        spawn(self._commands.serve(), "serve")
        spawn(self._lifetime.learn(), "learn-end")
        spawn(self._lifetime.keep(), "keep-end")
        spawn(self.emitter.heartbeats(settings.heartbeat_s, self._watch.recheck), "heartbeat")
        spawn(self._watch.watch(), "watch-record")
        spawn(self._watch.claim(), "claim")
        if status.stop_signal is not None:
            return await self._give_up(
                128 + status.stop_signal, "stopped before the worker started"
            )
        try:
            worker = await self._worker.start(command)
        except OSError as err:
            code = 127 if isinstance(err, FileNotFoundError) else 126
            if code == 127 and "/" not in command[0]:  # say where it was looked for
                err = FileNotFoundError(
                    f"{command[0]} not found: not installed here, or not on PATH "
                    f"({os.environ.get('PATH', '')})"
                )
            log.error("cannot start the worker %s: %s", command, err, extra=self._context.extra)
            return await self._give_up(code, f"cannot start the worker: {err}")
        if status.state is S.STARTING:  # else a signal came while it started
            status.move(S.WORKER_UP)
            self._lifetime.worker_started()
        emit(WorkerStarted, pid=worker.pid, command=bounded_command(command))
        if status.stop_signal is not None:
            worker.send_signal(status.stop_signal)
        if self.startd is not None:
            spawn(self._startd.observe(), "observe")
        else:
            self._claimable.set()
        returncode = await worker.wait()
        return await self._wind_down(worker.pid, returncode)

    async def _give_up(self, code: int, reason: str) -> int:
        self.status.winding_down = True
        self.status.seal_gate()
        self.status.move(S.EXITING)
        self.emitter.emit(AgentExiting, exit_code=code, reason=reason)
        self.emitter.emit(Heartbeat, interval_s=self.settings.heartbeat_s)
        return code

    async def _wind_down(self, pid: int, returncode: int) -> int:
        """The worker has ended: publish the last facts, ending with a heartbeat"""
        status, emit = self.status, self.emitter.emit
        status.winding_down = True
        await self._tasks.cancel()
        worker_status = exit_status(returncode)
        log.info("worker %d exited with %d", pid, worker_status, extra=self._context.extra)
        emit(
            WorkerExited,
            pid=pid,
            exit_code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
        )
        payloads_left = self._ledger.finish_all()
        if status.seal_gate():
            emit(GateClosed, reason="the worker exited")
        if status.state is S.DRAINING:
            status.move(S.DRAINED)
            emit(Drained)
            if status.ending is None and not payloads_left and worker_status in SELF_EXIT_STATUSES:
                # the startd finished the drain (exit on completion) and the master
                # followed before the drain flow had confirmed it: the planned end
                status.ending = "drained"
        code, reason = exit_decision(status, worker_status)
        if status.claimed and not status.released:
            # nothing runs and the gate is shut for good: let the record say so
            await self._record.finish(RecordPhase.DRAINED, f"agent exiting: {reason}", budget_s=3.0)
        status.exiting()
        emit(AgentExiting, exit_code=code, reason=reason)
        emit(Heartbeat, interval_s=self.settings.heartbeat_s)
        return code
