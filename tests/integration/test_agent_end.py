"""
The drone's end: the real agent, its gate and the shipped hooks on the emulated startd

A drone whose batch job ends lets in only payloads that end before it, drains itself in
time, vacates what still runs at the drain point (the overlay pool queues it again) and
ends its worker before the batch system would kill it. A notice (SIGTERM, SIGUSR1) moves the
end up to now plus the grace: the gate shuts at once, payloads that end in time finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from support.agent import FakeStartd, admitted, command, drain, read_events, running, settings
from support.waiting import wait_until

from broker.emulation.execution_point import EmulatorControl, install_fake_condor
from broker.manager.timeline import build
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.gate.server import GateServer
from remote_agent.htcondor import GATE_ATTRIBUTE, CondorStartd
from remote_agent.interfaces import END_REFUSED_STATUS, JobStart
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore

DRONE = "site1-0123456789"


@contextlib.asynccontextmanager
async def _drone(
    tmp_path: Path, url: str, **overrides: Any
) -> AsyncIterator[tuple[Agent, EmulatorControl]]:
    """The agent around the emulated master with two slots, its gate served"""
    env = install_fake_condor(tmp_path / "bin", tmp_path / "ep", slots=2)
    agent = Agent(
        settings(
            tmp_path,
            url,
            startd=True,
            slots=2,
            command=[str(tmp_path / "bin" / "condor_master"), "-f"],
            poll_s=0.2,
            **overrides,
        ),
        startd=CondorStartd(env=env),
        worker_env=env,
    )
    gate = GateServer(agent.settings.gate_socket, agent)
    await gate.start()
    agent.worker_env.update(gate.environment())
    ep = EmulatorControl(tmp_path / "ep")
    try:
        yield agent, ep
    finally:
        await gate.close()


async def _open(agent: Agent, ep: EmulatorControl) -> None:
    """Until the gate is open and the startd's START attribute says so"""
    await wait_until(lambda: agent.gate_open, 60, "the gate to open")
    for _ in range(600):
        if (await ep.status())["extras"].get(GATE_ATTRIBUTE) == "True":
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the startd's START attribute was never set")


def _finished(events: list[tuple[str, ev.AnyEvent]]) -> dict[str, ev.PayloadFinished]:
    return {e.job_id: e for _, e in events if isinstance(e, ev.PayloadFinished)}


async def test_a_drone_ends_before_its_batch_job_does_and_starts_nothing_that_would_not_fit(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    async with (
        _drone(tmp_path, nats_server.url, walltime_s=16.0, end_margin_s=3.0) as (agent, ep),
        running(agent) as run,
    ):
        await _open(agent, ep)
        end = agent.snapshot().end
        assert end is not None and end.source == "walltime" and end.notice == ""
        # its ad asks for two seconds: it fits
        fits = await ep.offer("1.0", 0.3, attributes={"AllowedJobDuration": 2})
        # its ad asks for an hour: it would outlive the drone
        too_long = await ep.offer("2.0", 0.3, attributes={"MaxWallTimeMins": 60})
        # no runtime in its ad: taken as --payload-runtime (0), so it is let in ...
        unknown = await ep.offer("3.0", 600.0)
        assert (fits["outcome"], too_long["outcome"], unknown["outcome"]) == (
            "started",
            "idle",
            "started",
        )
        assert too_long["status"] == END_REFUSED_STATUS
        assert "cannot finish before the drone's end" in too_long["message"]
        # ... and vacated at the drain point, so the drone ends itself
        assert await run.exit_code(60) == 0
    events = await read_events(js, DRONE)
    finished = _finished(events)
    assert (finished["1.0"].how, finished["1.0"].vacated) == (ev.PayloadEnd.EXIT, False)
    assert (finished["3.0"].how, finished["3.0"].vacated) == (ev.PayloadEnd.EVICT, True)
    started = [e for _, e in events if isinstance(e, ev.PayloadStarted)]
    assert [e.job_id for e in started] == ["1.0", "3.0"]
    [expired] = [e for _, e in events if isinstance(e, ev.DrainDeadlineExpired)]
    assert (expired.payloads, expired.action) == (1, "kill")  # vacated, whatever the policy
    last = events[-1][1]
    assert isinstance(last, ev.Heartbeat) and last.snapshot.state is ev.DroneState.EXITING
    assert last.snapshot.end is not None and last.snapshot.end.in_s > 0  # before its end
    # the startd's own record: the vacated payload was evicted by the startd, none died with it
    truth = ep.ground_truth()
    assert [e["job_id"] for e in truth if e["event"] == "payload_finished"] == ["1.0"]
    killed = [(e["job_id"], e["reason"]) for e in truth if e["event"] == "payload_killed"]
    assert killed == [("3.0", "drain_fast")]
    assert [e["reason"] for e in truth if e["event"] == "job_exit"] == ["exit", "evict"]
    assert truth[-1]["event"] == "master_exiting"
    # the gate said how long 1.0 may run: the snapshot, and so the manager, knows
    payloads = {p.job_id: p for _, e in events for p in e.snapshot.payloads}
    assert (payloads["1.0"].requested_s, payloads["3.0"].requested_s) == (2.0, None)


async def test_a_notice_shuts_the_gate_lets_what_fits_finish_and_vacates_the_rest(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    async with (
        _drone(tmp_path, nats_server.url, term_grace_s=12.0, end_margin_s=3.0) as (agent, ep),
        running(agent) as run,
    ):
        await _open(agent, ep)
        assert agent.snapshot().end is None  # no batch system, no walltime: no end known
        short = await ep.offer("1.0", 1.0, attributes={"AllowedJobDuration": 2})
        long = await ep.offer("2.0", 600.0, attributes={"AllowedJobDuration": 600})
        assert (short["outcome"], long["outcome"]) == ("started", "started")
        agent.notice(signal.SIGTERM)
        # in the same step: the gate is shut, the drone drains, the end is the notice's
        assert not agent.gate_open and agent.state is ev.DroneState.DRAINING
        end = agent.snapshot().end
        assert end is not None and (end.source, end.notice) == ("notice", "SIGTERM")
        assert end.in_s <= 12.0
        late = await ep.offer("3.0", 0.1)
        assert late["outcome"] != "started"
        assert await run.exit_code(60) == 0
    events = await read_events(js, DRONE)
    finished = _finished(events)
    assert (finished["1.0"].how, finished["1.0"].vacated) == (ev.PayloadEnd.EXIT, False)
    assert (finished["2.0"].how, finished["2.0"].vacated) == (ev.PayloadEnd.EVICT, True)
    assert "3.0" not in finished
    requested = next(e for _, e in events if isinstance(e, ev.DrainRequested))
    assert requested.intent.reason.startswith("end notice (SIGTERM)")
    rows = [row.drone_event for row in build(list(enumerate(e for _, e in events)))]
    notice = next(i for i, row in enumerate(rows) if row.startswith("end notice (SIGTERM)"))
    assert rows[notice + 1].startswith("drain_requested")  # the notice, then what it did
    truth = ep.ground_truth()
    assert [(e["job_id"], e["reason"]) for e in truth if e["event"] == "payload_killed"] == [
        ("2.0", "drain_fast")
    ]


async def test_the_end_moves_the_deadline_of_a_drain_in_progress_up_and_vacates(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    """TARDIS's drain lets payloads run for a day; a notice comes; the drain ends in time"""
    startd = FakeStartd()
    agent = Agent(
        settings(tmp_path, nats_server.url, startd=True, warning_grace_s=2.0, end_margin_s=1.0),
        startd=startd,
    )
    async with admitted(agent, startd, JobStart("5.0", "slot1_0@wn042", requested_s=7200.0)) as run:
        reply = await command(nc, drain(DRONE, deadline_s=86400.0))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        agent.notice(signal.SIGUSR1)
        # the drain's deadline is now the drone's end, less the margin: then it vacates
        await wait_until(lambda: ("drain", True) in startd.calls, what="the vacate")
        startd.run_job(0, None)  # the startd evicts it: its JOB_EXIT says so
        agent.job_exited("5.0", ev.PayloadEnd.EVICT, None, None)
        assert await run.exit_code() == 0
    events = await read_events(js, DRONE)
    moved = [e for _, e in events if isinstance(e, ev.Draining)]
    assert len(moved) == 2 and moved[1].deadline < moved[0].deadline
    finished = _finished(events)
    assert (finished["5.0"].how, finished["5.0"].vacated) == (ev.PayloadEnd.EVICT, True)
    assert any(isinstance(e, ev.DrainDeadlineExpired) and e.action == "kill" for _, e in events)
    notices = {e.snapshot.end.notice for _, e in events if e.snapshot.end is not None}
    assert notices == {"SIGUSR1"}


async def test_a_drain_past_its_deadline_under_wait_vacates_at_the_drones_end(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    """The "wait" policy lets a payload run past TARDIS's deadline, but not past the end"""
    startd = FakeStartd()
    agent = Agent(
        settings(tmp_path, nats_server.url, startd=True, warning_grace_s=1.5, end_margin_s=0.5),
        startd=startd,
    )
    async with admitted(agent, startd, JobStart("6.0", "slot1_0@wn042")) as run:
        reply = await command(nc, drain(DRONE, deadline_s=0.2))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED

        async def expired() -> bool:
            events = await read_events(js, DRONE)
            return any(isinstance(e, ev.DrainDeadlineExpired) for _, e in events)

        for _ in range(500):
            if await expired():
                break
            await asyncio.sleep(0.02)
        assert await expired()
        assert ("drain", True) not in startd.calls  # "wait": it runs on
        agent.notice(signal.SIGUSR2)
        await wait_until(lambda: ("drain", True) in startd.calls, what="the vacate")
        startd.run_job(0, None)
        agent.job_exited("6.0", ev.PayloadEnd.EVICT, None, None)
        assert await run.exit_code() == 0
    events = await read_events(js, DRONE)
    expiries = [e.action for _, e in events if isinstance(e, ev.DrainDeadlineExpired)]
    assert expiries == ["wait"]  # TARDIS's deadline; the end vacates without a second one
    finished = _finished(events)
    assert (finished["6.0"].how, finished["6.0"].vacated) == (ev.PayloadEnd.EVICT, True)


async def test_a_drone_whose_end_is_too_near_at_its_start_never_opens_its_gate(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    agent = Agent(settings(tmp_path, nats_server.url, walltime_s=0.5, end_margin_s=1.0))
    async with running(agent) as run:
        assert await run.exit_code() == 0
    kinds = [ev.kind_of(type(e)) for _, e in await read_events(js, DRONE)]
    assert "gate_opened" not in kinds
    assert {"drain_requested", "drained", "agent_exiting"} <= set(kinds)
