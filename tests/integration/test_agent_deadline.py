"""
A drain's deadline against a real nats-server: a command moves it up, never out

The manager records a drain before it sends the command; an agent that reads
the record first takes its deadline for no sooner than a self-drain's, and the
command that follows sets the deadline TARDIS asked for.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext
from support.agent import SITE, FakeStartd, admitted, command, drain, read_events, settings
from support.processes import CLI, run_process
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.interfaces import JobStart
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore

DRONE = "site1-0123456789"


def _deadline(agent: Agent) -> dt.datetime:
    intent = agent.snapshot().drain
    assert intent is not None
    return intent.deadline


async def _phase(store: RecordStore) -> ev.RecordPhase | None:
    current = await store.read(SITE, DRONE)
    return None if current is None else current.record.phase


async def test_the_command_after_its_record_sets_the_deadline_of_the_drain(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    """The record is read first (a day's deadline), the command then ends the drain on time"""
    startd = FakeStartd()
    agent = Agent(settings(tmp_path, nats_server.url, startd=True), startd=startd)
    async with admitted(agent, startd, JobStart("5.0", "slot1_1@wn042")) as run:
        request = drain(DRONE, request_id="r7", deadline_s=1.5)
        intent = ev.DrainIntent(
            deadline=request.deadline,
            reason=request.reason,
            request_id=request.request_id,
            requested_at=request.at,
        )
        await store.request_drain(SITE, DRONE, intent)  # as the manager does, first
        await wait_until(lambda: agent.state is ev.DroneState.DRAINING, what="the record's drain")
        far = request.at + dt.timedelta(seconds=agent.settings.self_drain_deadline_s)
        assert _deadline(agent) >= far

        reply = await command(nc, request)
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        assert reply.snapshot.drain is not None
        assert reply.snapshot.drain.deadline == request.deadline
        assert request.deadline.isoformat() in reply.detail
        assert _deadline(agent) == request.deadline

        for _ in range(1000):
            if await _phase(store) is ev.RecordPhase.DEADLINE_EXPIRED:
                break
            await asyncio.sleep(0.02)
        assert await _phase(store) is ev.RecordPhase.DEADLINE_EXPIRED
        assert [p.job_id for p in agent.payloads] == ["5.0"]  # policy "wait": still runs
        startd.run_job(0, None)
        agent.job_exited("5.0", ev.PayloadEnd.EXIT, 0, None)
        assert await run.exit_code() == 0
    events = [e for _, e in await read_events(js, DRONE)]
    accepted = [e for e in events if isinstance(e, ev.DrainAccepted)]
    assert len(accepted) == 1 and accepted[0].intent.deadline >= far  # from the record
    moved = [e for e in events if isinstance(e, ev.Draining) and e.deadline == request.deadline]
    assert len(moved) == 1 and moved[0].payloads == 1
    assert moved[0].snapshot.drain is not None
    assert moved[0].snapshot.drain.deadline == request.deadline
    expired = [e for e in events if isinstance(e, ev.DrainDeadlineExpired)]
    assert len(expired) == 1 and expired[0].at >= request.deadline
    # the reply came before the deadline: the expiry follows the moved deadline, not a day
    assert expired[0].at - request.deadline < dt.timedelta(minutes=1)
    assert await _phase(store) is ev.RecordPhase.DRAINED
    # what was asked for, as it reached the agent, and why the drain first took a later one
    (requested,) = [e for e in events if isinstance(e, ev.DrainRequested)]
    assert requested.intent.deadline == request.deadline
    code, out, err = await run_process(
        *CLI, "timeline", DRONE, "--server", nats_server.url, "--json"
    )
    assert code == 0, err
    texts = [row["drone_event"] for row in json.loads(out)]
    asked = f"{request.deadline:%H:%M:%S}"
    (drain_requested,) = [text for text in texts if text.startswith("drain_requested")]
    assert drain_requested == f"drain_requested, deadline {asked}"
    (drain_accepted,) = [text for text in texts if text.startswith("drain_accepted")]
    assert drain_accepted.endswith(
        "(held to the self-drain deadline until the manager's command confirms the one asked "
        f"for, {asked})"
    )
    assert f"draining: 1 payload(s), deadline {asked}" in texts


async def test_a_drain_command_moves_a_deadline_up_and_never_out(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    startd = FakeStartd()
    agent = Agent(settings(tmp_path, nats_server.url, startd=True), startd=startd)
    async with admitted(agent, startd, JobStart("5.0", "slot1_1@wn042")):
        first = drain(DRONE, request_id="r1", deadline_s=600)
        reply = await command(nc, first)
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        assert _deadline(agent) == first.deadline

        sooner = drain(DRONE, request_id="r2", deadline_s=300)
        reply = await command(nc, sooner)
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.ALREADY_DRAINING
        assert f"until {sooner.deadline.isoformat()}" in reply.detail
        assert reply.snapshot.drain is not None
        assert reply.snapshot.drain.deadline == sooner.deadline
        assert reply.snapshot.drain.request_id == "r1"  # still the first drain

        for later in (drain(DRONE, request_id="r1", deadline_s=900), drain(DRONE, "r3", 1200)):
            reply = await command(nc, later)
            assert isinstance(reply, ev.Reply)
            assert reply.outcome in (ev.Outcome.DRAIN_ACCEPTED, ev.Outcome.ALREADY_DRAINING)
            assert sooner.deadline.isoformat() in reply.detail
            assert _deadline(agent) == sooner.deadline
        startd.run_job(0, None)
        agent.job_exited("5.0", ev.PayloadEnd.EXIT, 0, None)
    draining = [e for _, e in await read_events(js, DRONE) if isinstance(e, ev.Draining)]
    assert [e.deadline for e in draining] == [first.deadline, sooner.deadline]
