"""Helpers for the agent tests: settings, a fake Startd, reading a drone's events back"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from broker.manager.service import ManagerService
from remote_agent.agent import Agent
from remote_agent.errors import StartdError
from remote_agent.interfaces import DrainResult, JobStart, SlotInfo
from remote_agent.protocol import events as ev
from remote_agent.protocol.events import check_sender
from remote_agent.protocol.names import Namespace
from remote_agent.settings import Settings
from support.waiting import wait_until

NS = Namespace()
SITE = "site1"
#: a worker that does nothing until it is told to stop
SLEEPER = ("sleep", "1000")


def settings(
    tmp_path: Path,
    url: str,
    drone: str = "site1-0123456789",
    *,
    startd: bool = False,
    command: Sequence[str] = SLEEPER,
    **overrides: Any,
) -> Settings:
    """Settings for one in-process agent, with test-friendly (short) times"""
    values: dict[str, Any] = {
        "heartbeat_s": 3600.0,
        "poll_s": 0.05,
        "end_grace_s": 0.2,
        "kill_after_s": 5.0,
        "exit_flush_s": 10.0,
        "publish_timeout_s": 1.0,
        "reconnect_wait_s": 0.1,
    }
    values.update(overrides)
    base = Settings(
        site=SITE,
        drone=drone,
        servers=(url,),
        worker_command=tuple(command),
        spool_dir=tmp_path / f"spool-{drone}",
        gate_socket=tmp_path / f"gate-{drone}.sock",
        startd=startd,
    )
    result = replace(base, **values)
    result.validate()
    return result


class FakeStartd:
    """A Startd that answers from plain attributes and records what it was asked"""

    def __init__(self, slots: int = 2) -> None:
        self.is_ready = True
        self.slot_list = [SlotInfo(f"slot1_{i}@wn042", "Unclaimed", "Idle") for i in range(slots)]
        self.calls: list[tuple[Any, ...]] = []
        self.fail = False
        self.slot_reads = 0  #: how often it was asked what its slots run (condor_who)

    async def ready(self) -> bool:
        return self.is_ready

    async def slots(self) -> list[SlotInfo]:
        self.slot_reads += 1
        if self.fail:
            raise StartdError("condor_who: cannot connect to the startd")
        return list(self.slot_list)

    async def set_accepting(self, accepting: bool) -> None:
        self.calls.append(("set_accepting", accepting))

    async def drain(self, reason: str, *, fast: bool = False) -> DrainResult:
        self.calls.append(("drain", fast))
        return DrainResult(accepted=True)

    def run_job(self, slot: int, job_id: str | None) -> None:
        old = self.slot_list[slot]
        state, activity = ("Claimed", "Busy") if job_id else ("Unclaimed", "Idle")
        self.slot_list[slot] = SlotInfo(old.name, state, activity, job_id)


class Running:
    """An agent running as a task of the test's event loop"""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.task = asyncio.create_task(agent.run())

    async def exit_code(self, timeout_s: float = 20.0) -> int:
        return await asyncio.wait_for(asyncio.shield(self.task), timeout_s)

    async def stop(self) -> int:
        if not self.task.done():
            self.agent.request_stop()
        return await self.exit_code()


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Running]:
    """Run ``agent``; at the end stop it if it still runs (and its worker with it)"""
    run = Running(agent)
    try:
        yield run
    finally:
        if not run.task.done():
            agent.request_stop()
            try:
                await asyncio.wait_for(asyncio.shield(run.task), 20)
            except TimeoutError:
                run.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run.task


@contextlib.asynccontextmanager
async def admitted(
    agent: Agent, startd: FakeStartd, job: JobStart, slot: int = 0
) -> AsyncIterator[Running]:
    """
    :func:`running`, with a payload in: once the gate opens it admits ``job``, which
    then runs on ``startd``'s slot number ``slot``
    """
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        assert agent.prepare_job(job).allow
        startd.run_job(slot, job.job_id)
        yield run


async def drone_life(
    service: ManagerService,
    agent: Agent,
    *,
    while_up: Callable[[], Awaitable[None]] | None = None,
    reason: str = "test",
) -> None:
    """
    An agent's whole life as the manager sees it, asserted step by step

    Its claim and first events reach the registry (record UP, drone IDLE);
    ``while_up`` runs; the manager's drain command reaches it and is answered;
    the agent ends with 0 and its final record says DRAINED.
    """
    site, drone = agent.settings.site, agent.settings.drone
    await asyncio.wait_for(service.ready.wait(), 30)
    async with running(agent) as run:
        await wait_until(
            lambda: (
                (view := service.registry.view(site, drone)) is not None
                and view.phase is ev.RecordPhase.UP
                and view.state is ev.DroneState.IDLE
            ),
            60,
            "the drone's claim and events at the manager",
        )
        if while_up is not None:
            await while_up()
        control = service.control
        assert control is not None
        drained = await control.drain(site, drone, reason=reason)
        assert drained.command is not None, drained  # the command reached the agent
        assert drained.outcome in ("accepted", "drained"), drained
        assert await run.exit_code(60) == 0
    await wait_until(
        lambda: (
            (view := service.registry.view(site, drone)) is not None
            and view.phase is ev.RecordPhase.DRAINED
        ),
        30,
        "the drone's final record at the manager",
    )


async def read_events(
    js: JetStreamContext, drone: str, site: str = SITE
) -> list[tuple[str, ev.AnyEvent]]:
    """Every event of one drone in stream order, with the ``Nats-Msg-Id`` it was stored with"""
    subject = NS.drone_events(site, drone)
    info = await js.stream_info(NS.event_stream, subjects_filter=subject)
    expected = (info.state.subjects or {}) if info.state else {}
    total = sum(expected.values())
    if not total:
        return []
    sub = await js.subscribe(subject, ordered_consumer=True)
    result: list[tuple[str, ev.AnyEvent]] = []
    try:
        while len(result) < total:
            msg = await sub.next_msg(timeout=5)
            headers = msg.headers or {}
            event = ev.decode_event(msg.data)
            check_sender(event, msg.subject, NS)
            result.append((headers.get("Nats-Msg-Id", ""), event))
    finally:
        await sub.unsubscribe()
    return result


async def kinds(js: JetStreamContext, drone: str) -> list[str]:
    return [ev.kind_of(type(event)) for _, event in await read_events(js, drone)]


async def command(nc: Client, message: ev.AnyCommand | bytes, drone: str = "") -> ev.AnyReply:
    """Send a command (or raw bytes) to a drone's command subject and decode the answer"""
    if isinstance(message, bytes):
        data, target = message, drone
    else:
        data, target = ev.encode(message), drone or message.drone
    msg = await nc.request(NS.command(SITE, target), data, timeout=5)
    return ev.decode_reply(msg.data)


def drain(drone: str, request_id: str = "r1", deadline_s: float = 600.0) -> ev.DrainCommand:
    now = ev.utcnow()
    return ev.DrainCommand(
        site=SITE,
        drone=drone,
        request_id=request_id,
        at=now,
        deadline=now + dt.timedelta(seconds=deadline_s),
        reason="demand dropped",
    )


def release_if_idle(drone: str, request_id: str = "q1") -> ev.ReleaseIfIdleCommand:
    return ev.ReleaseIfIdleCommand(site=SITE, drone=drone, request_id=request_id, at=ev.utcnow())


def status(drone: str, request_id: str = "s1") -> ev.StatusCommand:
    return ev.StatusCommand(site=SITE, drone=drone, request_id=request_id, at=ev.utcnow())
