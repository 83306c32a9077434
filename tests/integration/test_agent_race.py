"""A payload start racing a drain: allowed-then-drained or refused with 3xx, never in between"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.agent import NS, SITE, command, drain, read_events, running, settings
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.interfaces import GateDecision, JobStart
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore

ROUNDS = 24
PAYLOADS = 8
#: how the drain reaches the agent: the command, the record (a lost command), or both
ROUTES = ("command", "record", "both")
#: where a drone can be once the drain was accepted (with nothing running it ends at once)
CLOSED = (ev.DroneState.DRAINING, ev.DroneState.DRAINED, ev.DroneState.EXITING)


@dataclass
class Round:
    """One schedule: hook calls and one drain, each at a random moment"""

    drone: str
    request_id: str
    route: str
    early: bool  #: the drain command may arrive before the gate opened
    payload_delays: list[float]
    drain_delay: float
    #: (job id, decision, whether the drain command had been answered before)
    decisions: list[tuple[str, GateDecision, bool]] = field(default_factory=list)
    replied: bool = False

    @property
    def allowed(self) -> list[str]:
        return [job_id for job_id, decision, _ in self.decisions if decision.allow]


async def _payload(agent: Agent, plan: Round, job_id: str, delay: float) -> None:
    await asyncio.sleep(delay)
    plan.decisions.append((job_id, agent.prepare_job(JobStart(job_id)), plan.replied))


async def _drain(nc: Client, store: RecordStore, plan: Round) -> None:
    await asyncio.sleep(plan.drain_delay)
    request = drain(plan.drone, request_id=plan.request_id, deadline_s=60)
    if plan.route in ("record", "both"):
        intent = ev.DrainIntent(
            deadline=request.deadline,
            reason=request.reason,
            request_id=request.request_id,
            requested_at=request.at,
        )
        await store.request_drain(SITE, plan.drone, intent)
    if plan.route in ("command", "both"):
        while True:  # early: the agent may not have subscribed yet; retry, as managers do
            try:
                reply = await command(nc, request)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.005)
        assert isinstance(reply, ev.Reply), reply
        assert reply.outcome is ev.Outcome.DRAIN_ACCEPTED, reply
        assert not reply.snapshot.gate_open
        plan.replied = True


async def _run(agent: Agent, nc: Client, store: RecordStore, plan: Round) -> None:
    async with running(agent) as run:
        if not plan.early:
            await wait_until(lambda: agent.gate_open, what="the gate to open")
        await asyncio.gather(
            *(
                _payload(agent, plan, f"{i}.0", delay)
                for i, delay in enumerate(plan.payload_delays)
            ),
            _drain(nc, store, plan),
        )
        await wait_until(lambda: agent.state in CLOSED, what=f"the drain of {plan}")
        late = agent.prepare_job(JobStart("late.0"))
        assert not late.allow and 300 <= late.status_code < 400
        for job_id in plan.allowed:
            agent.job_exited(job_id, ev.PayloadEnd.EXIT, 0, None)
        assert await run.exit_code() == 0


async def _check(js: JetStreamContext, store: RecordStore, plan: Round) -> None:
    for job_id, decision, after_reply in plan.decisions:
        if decision.allow:
            assert not after_reply, f"{job_id} allowed after the drain was accepted"
        else:
            assert 300 <= decision.status_code < 400, decision
    events = [event for _, event in await read_events(js, plan.drone)]
    drained = [e.seq for e in events if isinstance(e, ev.Drained)]
    accepted = [e for e in events if isinstance(e, ev.DrainAccepted)]
    assert len(accepted) == 1 and accepted[0].intent.request_id == plan.request_id
    assert len(drained) == 1
    started = [e for e in events if isinstance(e, ev.PayloadStarted)]
    assert sorted(e.job_id for e in started) == sorted(plan.allowed)
    assert all(e.seq < accepted[0].seq for e in started), "a payload started after the drain"
    assert accepted[0].payloads == len(plan.allowed)
    finished = [e for e in events if isinstance(e, ev.PayloadFinished)]
    assert sorted(e.job_id for e in finished) == sorted(plan.allowed)
    assert all(e.seq < drained[0] for e in finished)
    assert all(not e.snapshot.gate_open for e in events if e.seq >= accepted[0].seq)
    record = await store.read(SITE, plan.drone)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINED


async def test_payload_start_racing_a_drain(
    tmp_path: Path, nats_server: EmbeddedServer, nc: Client, js: JetStreamContext
) -> None:
    await provision(js)
    store = await RecordStore.open(js, NS)
    rng = random.Random(172)
    allowed = refused = 0
    for i in range(ROUNDS):
        route = ROUTES[i % len(ROUTES)]
        plan = Round(
            drone=f"site1-race{i:04d}",
            request_id=f"r{i}",
            route=route,
            early=route == "command" and rng.random() < 0.3,
            payload_delays=[rng.uniform(0, 0.02) for _ in range(PAYLOADS)],
            drain_delay=rng.uniform(0, 0.02),
        )
        agent = Agent(settings(tmp_path, nats_server.url, plan.drone))
        await _run(agent, nc, store, plan)
        await _check(js, store, plan)
        allowed += len(plan.allowed)
        refused += len(plan.decisions) - len(plan.allowed)
    # the schedules produced both outcomes, so the race was really run
    assert allowed > 0 and refused > 0
