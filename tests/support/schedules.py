"""
The world the handshake's schedule test runs its schedules in, and the checks made as it goes

A real nats-server, the real manager and one drone's real agent behind a proxy that can
cut its connection; every operation notes what the test saw happen, and a
:class:`Violation` is raised the moment the handshake's guarantee is broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors

from broker.manager.control import Control
from broker.manager.outcomes import DrainOutcome, ReleaseOutcome, ReleaseResult
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.errors import GateUnavailable
from remote_agent.gate.client import ask
from remote_agent.gate.messages import GateDecisionReply, JobExitRequest, PrepareJobRequest
from remote_agent.gate.server import GateServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import HandshakeError
from support.agent import FakeStartd, read_events, settings
from support.servers import TcpProxy
from support.waiting import wait_until

SITE = "site1"
SLOTS = 3
LONG_DRAIN_S = 120.0
#: what a manager operation may fail with while the broker or manager restarts
TRANSIENT = (HandshakeError, nats.errors.Error, TimeoutError)


class Violation(AssertionError):
    """The handshake's guarantee was broken"""


@dataclass
class Drone:
    """One drone's agent, its (fake) startd, and what the test has seen happen to it"""

    name: str
    proxy: TcpProxy
    startd: FakeStartd = field(default_factory=lambda: FakeStartd(slots=SLOTS))
    agent: Agent | None = None
    gate: GateServer | None = None
    task: asyncio.Task[int] | None = None
    exit_code: int | None = None
    jobs: int = 0
    #: ground truth: job id -> slot index of payloads running on the startd
    running: dict[str, int] = field(default_factory=dict)
    allowed: list[str] = field(default_factory=list)
    release_won: bool = False
    released_or_drained: bool = False
    drain_accepted: bool = False
    deadline: float | None = None  #: epoch seconds of the earliest drain deadline
    log: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()


def _stacks() -> str:
    """Where every task of the loop is waiting (for a failure message)"""
    out = []
    for task in asyncio.all_tasks():
        frames = task.get_stack(limit=12)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
        out.append(f"{task.get_name()}: {where}")
    return "\n".join(sorted(out))


class World:
    """The nats-server, the manager and the drones of one test"""

    def __init__(self, server: EmbeddedServer, tmp_path: Path) -> None:
        self.server = server
        self.tmp_path = tmp_path
        self.manager: ManagerService | None = None
        self.manager_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------- the manager

    async def start_manager(self) -> None:
        self.manager = ManagerService(
            ManagerSettings(
                servers=(self.server.url,),
                lost_after_s=600.0,  # nobody goes lost inside one schedule
                lost_check_s=1.0,
                retry_s=0.2,
                request_timeout_s=1.0,
            )
        )
        self.manager_task = asyncio.create_task(self.manager.run())

    async def stop_manager(self) -> None:
        if self.manager is not None and self.manager_task is not None:
            self.manager.stop()
            await asyncio.wait_for(self.manager_task, 30)
        self.manager = self.manager_task = None

    async def control(self) -> Control:
        assert self.manager is not None
        await asyncio.wait_for(self.manager.ready.wait(), 60)
        assert self.manager.control is not None
        return self.manager.control

    # --------------------------------------------------------------- the agent

    async def start_agent(self, drone: Drone) -> None:
        if drone.alive or drone.exit_code is not None:
            return
        config = settings(
            self.tmp_path,
            drone.proxy.url,
            drone.name,
            startd=True,
            heartbeat_s=1.0,
            deadline_policy="wait",
        )
        agent = Agent(config, startd=drone.startd)
        gate = GateServer(config.gate_socket, agent)
        agent.worker_env.update(gate.environment())
        await gate.start()
        drone.agent, drone.gate = agent, gate
        drone.task = asyncio.create_task(agent.run())
        drone.task.add_done_callback(lambda task: _note_exit(drone, task))

    async def crash_agent(self, drone: Drone) -> None:
        """The agent dies without a word; its worker goes with it, the startd's jobs stay"""
        if not drone.alive:
            return
        assert drone.agent is not None and drone.task is not None and drone.gate is not None
        pid = drone.agent.snapshot().worker_pid
        drone.task.cancel()  # once, as an abrupt end would; the agent must not hang on it
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(drone.task), 20)
        assert drone.task.done(), f"{drone.name}: the agent did not stop when cancelled\n" + (
            _stacks()
        )
        if drone.agent.publisher is not None:  # a dead process's sockets close with it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(drone.agent.publisher.close(), 5)
        drone.exit_code = None  # a crash is not an exit: it will be restarted
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        await drone.gate.close()
        drone.agent = drone.task = drone.gate = None

    # ----------------------------------------------------------------- payloads

    async def payload_start(self, drone: Drone) -> None:
        """A claim arrives at a free slot: the starter asks the gate (PREPARE_JOB)"""
        if drone.agent is None or not drone.alive:
            return
        free = sorted(set(range(SLOTS)) - set(drone.running.values()))
        if not free:
            return
        drone.jobs += 1
        job_id = f"{drone.jobs}.0"
        accepted_before = drone.drain_accepted
        try:
            reply = await asyncio.to_thread(
                ask,
                drone.agent.settings.gate_socket,
                PrepareJobRequest(job_id=job_id, slot=f"slot1_{free[0]}"),
                10.0,
            )
        except GateUnavailable:
            return  # the hook refuses benignly (391): nothing starts
        assert isinstance(reply, GateDecisionReply), reply
        if not reply.allow:
            assert reply.status_code >= 300, reply  # never a hold
            return
        if drone.release_won:
            raise Violation(f"{drone.name}: payload {job_id} allowed after the manager won")
        if accepted_before:
            raise Violation(f"{drone.name}: payload {job_id} allowed after drain accepted")
        drone.allowed.append(job_id)
        drone.running[job_id] = free[0]
        drone.startd.run_job(free[0], job_id)

    async def payload_end(self, drone: Drone, job_id: str | None = None) -> None:
        if not drone.running:
            return
        job_id = job_id or sorted(drone.running)[0]
        slot = drone.running.pop(job_id)
        drone.startd.run_job(slot, None)
        if drone.agent is not None and drone.alive:
            with contextlib.suppress(GateUnavailable):
                await asyncio.to_thread(
                    ask,
                    drone.agent.settings.gate_socket,
                    JobExitRequest(job_id=job_id, how=ev.PayloadEnd.EXIT, exit_code=0),
                    10.0,
                )

    # ------------------------------------------------------------ manager ops

    async def release(self, drone: Drone) -> None:
        control = await self.control()
        try:
            result = await control.release(
                SITE, drone.name, deadline=_deadline(drone, LONG_DRAIN_S), reason="schedule test"
            )
        except TRANSIENT as err:
            drone.log.append(f"release failed: {err!r}")
            return
        drone.log.append(f"release: {result.outcome} {result.phase}")
        self._note_release(drone, result)

    async def drain(self, drone: Drone, seconds: float) -> None:
        control = await self.control()
        try:
            result = await control.drain(
                SITE, drone.name, deadline=_deadline(drone, seconds), reason="schedule test"
            )
        except TRANSIENT as err:
            drone.log.append(f"drain failed: {err!r}")
            return
        drone.log.append(f"drain: {result.outcome} {result.phase}")
        if result.outcome is DrainOutcome.NOT_ANNOUNCED:
            return  # nothing recorded: the drone must be released instead
        drone.released_or_drained = True
        self._note_drain(drone, result.outcome)

    async def drain_or_release(self, drone: Drone) -> None:
        """TARDIS's drain: the drone's drain, its release if its agent has not claimed"""
        control = await self.control()
        try:
            result = await control.drain_or_release(
                SITE, drone.name, deadline=_deadline(drone, LONG_DRAIN_S), reason="schedule test"
            )
        except TRANSIENT as err:
            drone.log.append(f"drain or release failed: {err!r}")
            return
        drone.log.append(f"drain or release: {result.outcome} {result.phase}")
        if isinstance(result, ReleaseResult):
            self._note_release(drone, result)
            return
        assert result.outcome is not DrainOutcome.NOT_ANNOUNCED, result
        drone.released_or_drained = True
        self._note_drain(drone, result.outcome)

    def _note_release(self, drone: Drone, result: ReleaseResult) -> None:
        drone.released_or_drained = True
        if result.outcome is ReleaseOutcome.RELEASED:
            drone.release_won = True
            if drone.allowed:
                raise Violation(f"{drone.name}: manager won a release after payloads started")
        elif result.drain is not None:
            self._note_drain(drone, result.drain.outcome)

    @staticmethod
    def _note_drain(drone: Drone, outcome: DrainOutcome) -> None:
        if outcome in (DrainOutcome.ACCEPTED, DrainOutcome.DRAINED):
            drone.drain_accepted = True

    # -------------------------------------------------------------- invariants

    def check_removal(self, drone: Drone) -> None:
        """A drone with a running payload is never removable before its deadline"""
        if self.manager is None or self.manager.control is None or not drone.running:
            return
        if drone.deadline is not None and time.time() >= drone.deadline:
            return  # after the agent's own deadline, removal may be allowed
        verdict = self.manager.control.may_remove(SITE, drone.name, lbs_running=True)
        if verdict:
            raise Violation(f"{drone.name}: removable with {sorted(drone.running)}: {verdict}")

    async def settle(self, drone: Drone) -> None:
        """Heal everything, let the drone run to its end, check how it ended"""
        await drone.proxy.restore_if_cut()
        control = await self.control()
        if not drone.alive and drone.exit_code is None:
            await self.start_agent(drone)  # the batch system runs the job eventually
        for job_id in sorted(drone.running):
            await self.payload_end(drone, job_id)
        give_up = time.monotonic() + 60
        while not drone.released_or_drained:  # drain once the agent has announced itself
            await self.drain(drone, LONG_DRAIN_S)
            if time.monotonic() > give_up:
                raise Violation(f"{drone.name}: never announced itself ({drone.log})")
            await asyncio.sleep(0.05)
        await wait_until(lambda: not drone.alive, 60, f"{drone.name} to end ({drone.log})")
        assert drone.task is not None
        code = drone.task.result()  # not drone.exit_code: its done-callback may still be due
        if code != 0:
            raise Violation(f"{drone.name}: agent exited {code} ({drone.log})")
        if drone.gate is not None:
            await drone.gate.close()
        await wait_until(
            lambda: bool(control.may_remove(SITE, drone.name, lbs_running=True)),
            30,
            f"{drone.name} to be removable ({drone.log})",
        )
        record = await control.store.read(SITE, drone.name)
        assert record is not None
        phase = record.record.phase
        expected = (
            {ev.RecordPhase.RELEASED}
            if drone.release_won
            else {ev.RecordPhase.DRAINED, ev.RecordPhase.DEADLINE_EXPIRED}
        )
        if phase not in expected:
            raise Violation(f"{drone.name}: ended {phase}, expected {expected} ({drone.log})")
        await self.check_stream(drone)

    async def check_stream(self, drone: Drone) -> None:
        """In the drone's own order (seq), nothing starts after it was closed for good"""
        assert self.manager is not None
        nc = await nats.connect(self.server.url)
        try:
            events = [event for _, event in await read_events(nc.jetstream(), drone.name)]
        finally:
            await nc.close()
        closed = False
        seen: set[str] = set()
        for event in sorted(events, key=lambda e: e.seq):
            if isinstance(event, ev.DrainAccepted | ev.Released):
                closed = True
            if isinstance(event, ev.GateOpened) and closed:
                raise Violation(f"{drone.name}: the gate opened again after it was sealed")
            if isinstance(event, ev.PayloadStarted):
                # a restarted agent announces the payloads it finds running again
                # (the same job ids): only a job never seen before is a new start
                if closed and event.job_id not in seen:
                    raise Violation(
                        f"{drone.name}: {event.job_id} started after the gate was sealed"
                    )
                seen.add(event.job_id)
        started = {e.job_id for e in events if isinstance(e, ev.PayloadStarted)}
        assert set(drone.allowed) <= started, (drone.allowed, started)
        if drone.release_won:
            assert not started and any(isinstance(e, ev.Released) for e in events)


def _note_exit(drone: Drone, task: asyncio.Task[int]) -> None:
    if not task.cancelled() and task.exception() is None:
        drone.exit_code = task.result()


def _deadline(drone: Drone, seconds: float) -> dt.datetime:
    deadline = time.time() + seconds
    drone.deadline = deadline if drone.deadline is None else min(drone.deadline, deadline)
    return dt.datetime.fromtimestamp(deadline, dt.UTC)


class Proxy(TcpProxy):
    """The agent's connection to the broker; cutting it loses commands sent meanwhile"""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.is_cut = False

    async def cut(self) -> None:
        if not self.is_cut:
            self.is_cut = True
            await super().cut()

    async def restore_if_cut(self) -> None:
        if self.is_cut:
            self.is_cut = False
            await self.restore()


@contextlib.asynccontextmanager
async def fresh_world(tmp_path: Path) -> AsyncIterator[World]:
    """A world of its own for one schedule: its server, its manager, nothing left over"""
    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    try:
        nc = await nats.connect(server.url)
        await provision(nc.jetstream())
        await nc.close()
        world = World(server, tmp_path)
        await world.start_manager()
        try:
            yield world
        finally:
            await world.stop_manager()
    finally:
        await server.stop()
