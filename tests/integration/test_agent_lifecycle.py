"""The drone agent against a real nats-server: lifecycle, commands, handshake outcomes"""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.agent import (
    SITE,
    FakeStartd,
    admitted,
    command,
    drain,
    kinds,
    read_events,
    release_if_idle,
    running,
    settings,
    status,
)
from support.processes import pid_exists
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.interfaces import GATE_CLOSED_STATUS, JobStart, SlotInfo
from remote_agent.protocol import events as ev
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.handshake import RecordStore

DRONE = "site1-0123456789"


async def test_lifecycle_publishes_the_right_events_in_order(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    startd = FakeStartd()
    agent = Agent(settings(tmp_path, nats_server.url, startd=True), startd=startd)
    async with admitted(agent, startd, JobStart("1234.0", "slot1_1@wn042")) as run:
        assert agent.state is ev.DroneState.BUSY

        reply = await command(nc, drain(DRONE))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        assert not reply.snapshot.gate_open and len(reply.snapshot.payloads) == 1
        refused = agent.prepare_job(JobStart("1235.0", "slot1_2@wn042"))
        assert (refused.allow, refused.status_code) == (False, GATE_CLOSED_STATUS)

        startd.run_job(0, None)
        agent.job_exited("1234.0", ev.PayloadEnd.EXIT, 0, 12.5)
        assert await run.exit_code() == 0

    assert await kinds(js, DRONE) == [
        "agent_started",
        "worker_started",
        "startd_ready",
        "gate_opened",
        "payload_started",
        "drain_requested",
        "drain_accepted",
        "gate_closed",
        "draining",
        "payload_finished",
        "drained",
        "worker_exited",
        "agent_exiting",
        "heartbeat",
    ]
    events = await read_events(js, DRONE)
    seqs = [event.seq for _, event in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(msg_id == event.id for msg_id, event in events)
    states = [event.snapshot.state for _, event in events]
    assert states[:4] == ["starting", "worker_up", "startd_ready", "idle"]
    assert states[4] == "busy" and states[-1] == "exiting"
    finished = events[9][1]
    assert isinstance(finished, ev.PayloadFinished)
    assert (finished.job_id, finished.how, finished.duration_s) == ("1234.0", "exit", 12.5)
    last = events[-1][1]
    assert not last.snapshot.gate_open and last.snapshot.payloads == []
    record = await store.read(SITE, DRONE)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINED
    assert record.record.drain is not None and record.record.drain.request_id == "r1"
    # the START attribute followed the gate; the startd was drained gracefully
    assert startd.calls == [("set_accepting", True), ("set_accepting", False), ("drain", False)]


async def test_release_before_the_agent_came_up(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    await store.release(SITE, DRONE, note="demand dropped while booting")
    agent = Agent(settings(tmp_path, nats_server.url))
    allowed = []
    async with running(agent) as run:
        while not run.task.done():
            allowed.append(agent.prepare_job(JobStart("1.0")).allow)
            await asyncio.sleep(0.005)
        assert await run.exit_code() == 0
    assert allowed and not any(allowed)
    assert await kinds(js, DRONE) == [
        "agent_started",
        "worker_started",
        "released",
        "worker_exited",
        "agent_exiting",
        "heartbeat",
    ]
    events = [event for _, event in await read_events(js, DRONE)]
    assert isinstance(events[2], ev.Released)
    assert events[2].reason == "demand dropped while booting"
    assert all(not event.snapshot.gate_open for event in events)
    record = await store.read(SITE, DRONE)
    assert record is not None and record.record.phase is ev.RecordPhase.RELEASED
    worker_pid = events[1].pid  # type: ignore[union-attr]
    assert not pid_exists(worker_pid)


async def test_release_if_idle_ends_the_drone(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    agent = Agent(settings(tmp_path, nats_server.url))
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        reply = await command(nc, release_if_idle(DRONE))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.RELEASED
        assert reply.snapshot.state is ev.DroneState.DRAINED and not reply.snapshot.gate_open
        assert not agent.prepare_job(JobStart("7.0")).allow
        assert await run.exit_code() == 0
    record = await store.read(SITE, DRONE)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINED
    assert (await kinds(js, DRONE))[2:5] == ["gate_opened", "gate_closed", "drained"]


async def test_commands_repeated_give_the_same_outcome(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    startd = FakeStartd()
    agent = Agent(settings(tmp_path, nats_server.url, startd=True, end_grace_s=60.0), startd=startd)
    async with admitted(agent, startd, JobStart("1.0", "slot1_1@wn042")) as run:

        async def outcome(message: ev.AnyCommand) -> ev.Outcome:
            reply = await command(nc, message)
            assert isinstance(reply, ev.Reply) and reply.request_id == message.request_id
            return reply.outcome

        assert [await outcome(status(DRONE)) for _ in range(2)] == [ev.Outcome.STATUS] * 2
        before = len(await read_events(js, DRONE))
        assert [await outcome(release_if_idle(DRONE)) for _ in range(2)] == [ev.Outcome.BUSY] * 2
        assert agent.state is ev.DroneState.BUSY and agent.gate_open
        assert len(await read_events(js, DRONE)) == before  # nothing happened

        first = drain(DRONE, "r1")
        assert [await outcome(first) for _ in range(3)] == [ev.Outcome.DRAIN_ACCEPTED] * 3
        assert await outcome(drain(DRONE, "r2")) is ev.Outcome.ALREADY_DRAINING
        assert (await kinds(js, DRONE)).count("drain_accepted") == 1

        startd.run_job(0, None)
        agent.job_exited("1.0", ev.PayloadEnd.EXIT, 0, None)
        await wait_until(lambda: agent.state is ev.DroneState.DRAINED, what="drained")
        assert [await outcome(first) for _ in range(2)] == [ev.Outcome.DRAINED] * 2
        assert await outcome(release_if_idle(DRONE)) is ev.Outcome.RELEASED
        assert (await kinds(js, DRONE)).count("drained") == 1
        assert await run.stop() == 128 + 15  # a SIGTERM from outside: the worker's status
    record = await store.read(SITE, DRONE)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINED


async def test_garbage_on_the_command_subject_changes_nothing(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    agent = Agent(settings(tmp_path, nats_server.url))
    async with running(agent):
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        await wait_until(lambda: not len(agent.publisher.spool), what="events published")  # type: ignore[union-attr]
        before = await read_events(js, DRONE)
        snapshot = agent.snapshot()
        other = drain("site1-9999999999")
        garbage: list[tuple[bytes, str]] = [
            (b"\xc1", "malformed command"),
            (b"\x81\xa4kind\xa3foo", "invalid command"),
            (ev.encode(before[0][1]), "invalid command"),  # an event, not a command
            (ev.encode(other), "reached the agent of site1/site1-0123456789"),
            (b"\x90" * (DEFAULT_MAX_SIZE + 1), "exceeds the limit"),
        ]
        for data, error in garbage:
            reply = await command(nc, data, drone=DRONE)
            assert isinstance(reply, ev.ErrorReply), reply
            assert error in reply.error
        assert agent.counters["command_errors"] == len(garbage)
        assert agent.snapshot() == snapshot
        assert await read_events(js, DRONE) == before
    record = await store.read(SITE, DRONE)
    assert record is not None  # the foreign drain wrote nothing for the other drone
    assert await store.read(SITE, "site1-9999999999") is None


@pytest.mark.parametrize("policy", ["kill", "wait"])
async def test_drain_deadline_expires(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
    policy: str,
) -> None:
    startd = FakeStartd()
    agent = Agent(
        settings(tmp_path, nats_server.url, startd=True, deadline_policy=policy), startd=startd
    )
    async with admitted(agent, startd, JobStart("5.0", "slot1_1@wn042")) as run:
        reply = await command(nc, drain(DRONE, deadline_s=0.3))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED

        async def phase() -> ev.RecordPhase | None:
            current = await store.read(SITE, DRONE)
            return current.record.phase if current else None

        for _ in range(1000):
            if await phase() is ev.RecordPhase.DEADLINE_EXPIRED:
                break
            await asyncio.sleep(0.02)
        assert await phase() is ev.RecordPhase.DEADLINE_EXPIRED
        assert agent.state is ev.DroneState.DRAINING  # the payload still runs
        startd.run_job(0, None)
        agent.job_exited(
            "5.0", ev.PayloadEnd.EVICT if policy == "kill" else ev.PayloadEnd.EXIT, None, None
        )
        assert await run.exit_code() == 0
    expired = [e for _, e in await read_events(js, DRONE) if isinstance(e, ev.DrainDeadlineExpired)]
    assert len(expired) == 1 and expired[0].action == policy and expired[0].payloads == 1
    assert (
        ("drain", True) in startd.calls if policy == "kill" else ("drain", True) not in startd.calls
    )
    assert await phase() is ev.RecordPhase.DRAINED
    assert (await kinds(js, DRONE))[-5:] == [
        "payload_finished",
        "drained",
        "worker_exited",
        "agent_exiting",
        "heartbeat",
    ]


async def test_the_startd_poll_is_a_backstop_for_the_hooks(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    startd = FakeStartd()
    agent = Agent(settings(tmp_path, nats_server.url, startd=True), startd=startd)
    async with admitted(agent, startd, JobStart("1.0", "slot1_1@wn042")) as run:
        startd.run_job(1, "2.0")  # never passed the gate (an earlier agent let it in)
        await wait_until(lambda: len(agent.payloads) == 2, what="the unknown payload counted")
        startd.run_job(0, None)  # vanished without a JOB_EXIT hook
        await wait_until(lambda: len(agent.payloads) == 1, what="the vanished payload finished")
        assert [p.job_id for p in agent.payloads] == ["2.0"]
        assert await run.stop() == 128 + 15
    events = [e for _, e in await read_events(js, DRONE)]
    finished = [e for e in events if isinstance(e, ev.PayloadFinished)]
    assert [(e.job_id, e.how) for e in finished] == [("1.0", "unknown"), ("2.0", "unknown")]
    started = [e for e in events if isinstance(e, ev.PayloadStarted)]
    assert [(e.job_id, e.slot) for e in started] == [
        ("1.0", "slot1_1@wn042"),
        ("2.0", "slot1_1@wn042"),
    ]


async def test_a_restarted_agent_counts_the_payloads_already_running(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    startd = FakeStartd()
    startd.run_job(1, "42.0")  # let in by an earlier incarnation of the agent
    agent = Agent(settings(tmp_path, nats_server.url, startd=True), startd=startd)
    async with running(agent):
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        assert agent.state is ev.DroneState.BUSY
        assert [p.job_id for p in agent.payloads] == ["42.0"]
        reply = await command(nc, release_if_idle(DRONE))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.BUSY
    started = [e for _, e in await read_events(js, DRONE) if isinstance(e, ev.PayloadStarted)]
    assert [(e.job_id, e.slot, e.snapshot.state) for e in started] == [
        ("42.0", "slot1_1@wn042", ev.DroneState.STARTD_READY)
    ]


async def test_a_drain_recorded_for_an_earlier_incarnation_is_carried_on(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    await store.claim(SITE, DRONE, "earlier")
    now = ev.utcnow()
    intent = ev.DrainIntent(
        deadline=now + dt.timedelta(minutes=5), reason="old", request_id="r0", requested_at=now
    )
    await store.request_drain(SITE, DRONE, intent)
    agent = Agent(settings(tmp_path, nats_server.url))
    async with running(agent) as run:
        assert await run.exit_code() == 0
        assert not agent.prepare_job(JobStart("1.0")).allow
    kinds_ = await kinds(js, DRONE)
    assert "gate_opened" not in kinds_
    assert kinds_[2:5] == ["drain_requested", "drain_accepted", "drained"]
    record = await store.read(SITE, DRONE)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINED
    assert record.record.drain == intent


async def test_a_master_that_ends_before_the_drain_is_confirmed_ends_the_job_as_planned(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    """
    The startd drained with exit on completion and the master exited (99) while the
    agent was still asking the startd whether anything runs: the drain is complete,
    and the drone's job ends with 0, not with the master's 99 (seen in the demo)
    """

    class SlowStartd(FakeStartd):
        stuck = False
        asked_stuck = False  # someone waits for condor_who's answer

        async def slots(self) -> list[SlotInfo]:
            if self.stuck:  # condor_who of a startd that is shutting down
                self.asked_stuck = True
                await asyncio.Event().wait()
            return await super().slots()

    flag = tmp_path / "master-exits"
    worker = ["sh", "-c", f'while [ ! -e "{flag}" ]; do sleep 0.02; done; exit 99']
    startd = SlowStartd()
    agent = Agent(
        settings(tmp_path, nats_server.url, startd=True, command=worker, poll_s=60.0),
        startd=startd,
    )
    async with admitted(agent, startd, JobStart("5.0", "slot1_1@wn042")) as run:
        reply = await command(nc, drain(DRONE))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        startd.stuck = True
        startd.run_job(0, None)
        agent.job_exited("5.0", ev.PayloadEnd.EXIT, 0, None)  # the last payload ends
        await wait_until(lambda: startd.asked_stuck, what="the drain flow to wait for condor_who")
        flag.touch()  # ... and the master exits first
        assert await run.exit_code() == 0
    exiting = [e for _, e in await read_events(js, DRONE) if isinstance(e, ev.AgentExiting)]
    assert [(e.exit_code, e.reason) for e in exiting] == [(0, "drained")]
    current = await store.read(SITE, DRONE)
    assert current is not None and current.record.phase is ev.RecordPhase.DRAINED
