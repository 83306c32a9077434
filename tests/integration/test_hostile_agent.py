"""
The real agent and its real gate against a hostile process on the drone and a lost record

A process on the drone can talk to the gate: it may lie about payload ends and
flood PREPARE_JOB. The startd stays the authority on "idle", the snapshot stays
bounded, and a record that no longer names the running agent shuts the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.agent import (
    NS,
    SITE,
    FakeStartd,
    command,
    drain,
    read_events,
    release_if_idle,
    running,
    settings,
)
from support.manager import running_manager
from support.processes import run_process
from support.waiting import wait_until

from broker.emulation.execution_point import DEPLOY_DIR as EP_DEPLOY_DIR
from broker.emulation.execution_point import EmulatorControl, install_fake_condor
from broker.manager.service import ManagerSettings
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.gate.client import ask
from remote_agent.gate.messages import GateDecisionReply, PrepareJobRequest
from remote_agent.gate.paths import GATE_ENV, PYTHON_ENV
from remote_agent.gate.server import GateServer
from remote_agent.htcondor import GATE_ATTRIBUTE, CondorStartd
from remote_agent.interfaces import GATE_CLOSED_STATUS, JobStart, SlotInfo
from remote_agent.protocol import events as ev
from remote_agent.protocol.fields import MAX_JOB_ID
from remote_agent.protocol.handshake import RecordStore

DRONE = "site1-0123456789"
ROOT = Path(__file__).resolve().parents[2]
JOBS = ("101.0", "102.0")

#: a process on the drone: sends forged JOB_EXITs for the job ids on its command line
_FORGER = """
import sys
from pathlib import Path
from remote_agent.protocol.events import PayloadEnd
from remote_agent.gate.client import ask
from remote_agent.gate.messages import GateAck, JobExitRequest
for job_id in sys.argv[2:]:
    reply = ask(Path(sys.argv[1]), JobExitRequest(job_id=job_id, how=PayloadEnd.EXIT), 10.0)
    assert isinstance(reply, GateAck), reply
"""


@dataclass
class Drone:
    agent: Agent
    gate: GateServer
    startd: FakeStartd


@pytest.fixture
async def drone(
    tmp_path: Path, nats_server: EmbeddedServer, store: RecordStore
) -> AsyncIterator[Drone]:
    startd = FakeStartd(slots=2)
    agent = Agent(settings(tmp_path, nats_server.url, startd=True, slots=2), startd=startd)
    gate = GateServer(agent.settings.gate_socket, agent)
    await gate.start()
    try:
        yield Drone(agent, gate, startd)
    finally:
        await gate.close()


async def _prepare(path: Path, job_id: str) -> GateDecisionReply:
    reply = await asyncio.to_thread(ask, path, PrepareJobRequest(job_id=job_id, slot="s"), 10.0)
    assert isinstance(reply, GateDecisionReply), reply
    return reply


async def _forge_exits(path: Path, *job_ids: str) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _FORGER, str(path), *job_ids],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()


async def _start_two(d: Drone) -> None:
    await wait_until(lambda: d.agent.gate_open, what="the gate to open")
    for slot, job_id in enumerate(JOBS):
        assert (await _prepare(d.gate.path, job_id)).allow
        d.startd.run_job(slot, job_id)
    assert {p.job_id for p in d.agent.payloads} == set(JOBS)


async def _phase(store: RecordStore) -> ev.RecordPhase | None:
    current = await store.read(SITE, DRONE)
    return None if current is None else current.record.phase


# --------------------------------------------------------------------------- case 3


async def test_forged_job_exits_do_not_make_a_busy_drone_idle(
    drone: Drone, nc: Client, js: JetStreamContext, store: RecordStore
) -> None:
    d = drone
    async with running(d.agent) as run:
        await _start_two(d)
        await _forge_exits(d.gate.path, *JOBS, "999.0")
        await wait_until(
            lambda: d.agent.counters["job_exits_unconfirmed"] == len(JOBS),
            what="the startd asked about the forged exits",
        )
        # the startd still runs both: they stay in the snapshot, and no end is published
        assert {p.job_id for p in d.agent.payloads} == set(JOBS)
        assert d.agent.state is ev.DroneState.BUSY
        assert d.agent.counters["job_exit_unknown"] == 1  # a job the gate never saw
        published = [e for _, e in await read_events(js, DRONE)]
        assert not [e for e in published if isinstance(e, ev.PayloadFinished)]

        # release-if-idle lets nothing go
        reply = await command(nc, release_if_idle(DRONE))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.BUSY, reply
        assert "2 payload(s) running" in reply.detail
        assert d.agent.state is not ev.DroneState.DRAINED
        assert await _phase(store) is ev.RecordPhase.UP

        # a drain waits for the startd, not for the hooks
        reply = await command(nc, drain(DRONE))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        asked = d.startd.slot_reads
        await wait_until(
            lambda: d.startd.slot_reads >= asked + 5, what="the drain to ask the startd again"
        )
        assert d.agent.state is ev.DroneState.DRAINING
        assert await _phase(store) is ev.RecordPhase.DRAINING
        reply = await command(nc, release_if_idle(DRONE, "q2"))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.BUSY, reply
        assert not run.task.done()

        # the payloads really end: now the drone is drained
        d.startd.run_job(0, None)
        d.startd.run_job(1, None)
        assert await run.exit_code(30) == 0
    assert await _phase(store) is ev.RecordPhase.DRAINED
    ends = [e.job_id for _, e in await read_events(js, DRONE) if isinstance(e, ev.PayloadFinished)]
    assert sorted(ends) == sorted(JOBS)  # each published once, when the startd let it go


async def test_a_claimed_slot_without_a_job_is_busy(
    drone: Drone, nc: Client, store: RecordStore
) -> None:
    d = drone
    async with running(d.agent):
        await wait_until(lambda: d.agent.gate_open, what="the gate to open")
        # claimed, the job not started yet (input transfer, PREPARE_JOB pending)
        d.startd.slot_list[0] = SlotInfo(d.startd.slot_list[0].name, "Claimed", "Idle")
        reply = await command(nc, release_if_idle(DRONE))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.BUSY, reply
        assert d.agent.gate_open
        d.startd.slot_list[0] = SlotInfo(d.startd.slot_list[0].name, "Unclaimed", "Idle")
        reply = await command(nc, release_if_idle(DRONE, "q2"))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.RELEASED, reply


async def test_a_startd_that_does_not_answer_is_not_idle(
    drone: Drone, nc: Client, store: RecordStore
) -> None:
    d = drone
    async with running(d.agent):
        await wait_until(lambda: d.agent.gate_open, what="the gate to open")
        d.startd.fail = True  # the worker (condor_master) still runs
        reply = await command(nc, release_if_idle(DRONE))
        assert isinstance(reply, ev.Reply)
        assert reply.outcome is ev.Outcome.BUSY, reply
        assert "does not answer" in reply.detail
        assert d.agent.gate_open
        assert await _phase(store) is ev.RecordPhase.UP


# --------------------------------------------------------------------------- case 4


def _released() -> bytes:
    record = ev.DroneRecord(
        site=SITE,
        drone=DRONE,
        phase=ev.RecordPhase.RELEASED,
        writer="manager",
        at=ev.utcnow(),
        note="gone",
    )
    return ev.encode(record)


def _other_up() -> bytes:
    record = ev.DroneRecord(
        site=SITE,
        drone=DRONE,
        phase=ev.RecordPhase.UP,
        writer="agent",
        incarnation="someone-else",
        at=ev.utcnow(),
    )
    return ev.encode(record)


@pytest.mark.parametrize("rewrite", ["released", "deleted", "other_up", "garbage"])
async def test_a_lost_record_closes_the_gate_and_drains(
    drone: Drone, js: JetStreamContext, store: RecordStore, rewrite: str
) -> None:
    d = drone
    key = NS.record_key(SITE, DRONE)
    async with running(d.agent) as run:
        await wait_until(lambda: d.agent.gate_open, what="the gate to open")
        assert (await _prepare(d.gate.path, "7.0")).allow
        d.startd.run_job(0, "7.0")
        if rewrite == "deleted":
            await store.kv.delete(key)
        else:
            value = {"released": _released, "other_up": _other_up}.get(rewrite, lambda: b"\xc1")
            await store.kv.put(key, value())
        await wait_until(lambda: not d.agent.gate_open, what="the gate to close")
        refused = await _prepare(d.gate.path, "8.0")
        assert (refused.allow, refused.status_code) == (False, GATE_CLOSED_STATUS)
        # the running payload is not killed: the drone drains
        assert d.agent.state is ev.DroneState.DRAINING
        assert [p.job_id for p in d.agent.payloads] == ["7.0"]
        assert not run.task.done()
        d.startd.run_job(0, None)
        d.agent.job_exited("7.0", ev.PayloadEnd.EXIT, 0, None)
        assert await run.exit_code(30) == 0
    events = [event for _, event in await read_events(js, DRONE)]
    closed = [e for e in events if isinstance(e, ev.GateClosed)]
    assert closed and closed[0].reason.startswith("record lost:"), closed
    started = [e.job_id for e in events if isinstance(e, ev.PayloadStarted)]
    assert started == ["7.0"]
    # the agent never wrote the record again
    if rewrite == "released":
        assert await _phase(store) is ev.RecordPhase.RELEASED
    elif rewrite == "other_up":
        current = await store.read(SITE, DRONE)
        assert current is not None and current.record.incarnation == "someone-else"


# --------------------------------------------------------------------------- case 9


async def test_a_prepare_job_flood_drops_no_event(
    drone: Drone, js: JetStreamContext, store: RecordStore
) -> None:
    d = drone
    flood = 800  # unbounded, 800 payloads of 64-character ids make a snapshot > 64 KiB
    async with running(d.agent) as run:
        await wait_until(lambda: d.agent.gate_open, what="the gate to open")
        stem = "9" * (MAX_JOB_ID - 4)
        replies = []
        for n in range(flood):
            job_id = f"{stem}.{n:03d}"
            replies.append(reply := await _prepare(d.gate.path, job_id))
            if reply.allow:  # the startd runs what the gate let in
                d.startd.run_job(len([r for r in replies if r.allow]) - 1, job_id)
        allowed = [r for r in replies if r.allow]
        assert len(allowed) == 2  # the drone's slots
        assert all(r.status_code == GATE_CLOSED_STATUS for r in replies if not r.allow)
        assert d.agent.counters["payloads_refused_over_slots"] == flood - 2
        too_long = await _prepare(d.gate.path, "1" * (MAX_JOB_ID + 1))
        assert (too_long.allow, too_long.status_code) == (False, GATE_CLOSED_STATUS)
        await run.stop()
    publisher = d.agent.publisher
    assert publisher is not None
    assert publisher.rejected == 0
    events = await read_events(js, DRONE)
    assert len(events) == publisher.published - publisher.duplicates
    assert isinstance(events[-1][1], ev.Heartbeat), "the last heartbeat was stored"


@contextlib.asynccontextmanager
async def _busy_drone(tmp_path: Path, url: str) -> AsyncIterator[Agent]:
    """A running agent with the policy "kill" and one payload, 7.0, let in by its gate"""
    startd = FakeStartd(slots=2)
    agent = Agent(
        settings(tmp_path, url, startd=True, slots=2, deadline_policy="kill"), startd=startd
    )
    gate = GateServer(agent.settings.gate_socket, agent)
    await gate.start()
    try:
        async with running(agent):
            await wait_until(lambda: agent.gate_open, what="the gate to open")
            assert (await _prepare(gate.path, "7.0")).allow
            startd.run_job(0, "7.0")
            yield agent
    finally:
        await gate.close()


async def _forge_drain(store: RecordStore, request_id: str = "") -> dt.datetime:
    """Put a ``draining`` record with a deadline of now, as another drone can; return now"""
    current = await store.read(SITE, DRONE)
    assert current is not None
    now = ev.utcnow()
    intent = ev.DrainIntent(deadline=now, reason="forged", request_id=request_id, requested_at=now)
    forged = msgspec.structs.replace(
        current.record, phase=ev.RecordPhase.DRAINING, writer="manager", drain=intent, at=now
    )
    await store.kv.put(NS.record_key(SITE, DRONE), ev.encode(forged))
    return now


async def test_a_drain_deadline_read_from_the_record_counts_no_sooner_than_a_self_drain(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    """
    What the record says may come from another drone (the server stores what a
    reply subject sends there): a drain deadline in the past read from it must
    not end in ``deadline_expired``, which lets the manager remove the drone
    """
    async with _busy_drone(tmp_path, nats_server.url) as agent:
        now = await _forge_drain(store)
        await wait_until(lambda: agent.state is ev.DroneState.DRAINING, what="a drain")
        await asyncio.sleep(1.0)
        assert (await _phase(store)) is ev.RecordPhase.DRAINING  # no deadline_expired
        assert [p.job_id for p in agent.payloads] == ["7.0"]  # nothing killed
        intent = agent.snapshot().drain
        assert intent is not None
        assert (intent.deadline - now).total_seconds() >= agent.settings.self_drain_deadline_s


async def test_a_forged_record_never_moves_a_drain_deadline_up(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    """
    Only a command moves a deadline up: a forged record with a passed deadline,
    read before the manager's command or during its drain, shortens nothing
    """
    async with _busy_drone(tmp_path, nats_server.url) as agent:
        # the same request id as the manager's command that follows
        await _forge_drain(store, request_id="r1")
        await wait_until(lambda: agent.state is ev.DroneState.DRAINING, what="a drain")
        request = drain(DRONE, request_id="r1", deadline_s=600)
        reply = await command(nc, request)
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        assert reply.snapshot.drain is not None
        assert reply.snapshot.drain.deadline == request.deadline  # the command's, not now

        await _forge_drain(store, request_id="r1")
        await asyncio.sleep(1.0)
        assert (await _phase(store)) is ev.RecordPhase.DRAINING  # no deadline_expired
        assert [p.job_id for p in agent.payloads] == ["7.0"]  # nothing killed
        intent = agent.snapshot().drain
        assert intent is not None and intent.deadline == request.deadline
    events = [e for _, e in await read_events(js, DRONE)]
    assert not [e for e in events if isinstance(e, ev.DrainDeadlineExpired)]


# --------------------------------------------------------------------------- a lying payload


async def _hook_job_exit(gate: Path, job_id: str, exit_code: int = 0) -> None:
    """The shipped JOB_EXIT hook, run by a payload that reports ``job_id`` ended"""
    cluster, proc = job_id.split(".")
    ad = f"ClusterId = {cluster}\nProcId = {proc}\nExitBySignal = false\nExitCode = {exit_code}\n"
    env = {**os.environ, PYTHON_ENV: sys.executable, GATE_ENV: str(gate)}
    code, _, err = await run_process(
        EP_DEPLOY_DIR / "hook-job-exit", "exit", input=ad.encode(), env=env
    )
    assert code == 0, err


async def test_a_payload_reporting_ends_that_did_not_happen_changes_nothing(
    tmp_path: Path, nats_server: EmbeddedServer, store: RecordStore
) -> None:
    """
    The real agent, its gate and the shipped hooks on the emulated startd: a payload tells
    the gate that it and its neighbour ended; the startd runs both, so both stay in the
    snapshot and the manager's view, until the startd really lets one go
    """
    env = install_fake_condor(
        tmp_path / "bin", tmp_path / "ep", slots=2, extra_config={"SHUTDOWN_GRACEFUL_TIMEOUT": "1"}
    )
    agent = Agent(
        settings(
            tmp_path,
            nats_server.url,
            startd=True,
            slots=2,
            command=[str(tmp_path / "bin" / "condor_master"), "-f"],
            poll_s=1.0,
        ),
        startd=CondorStartd(env=env),
        worker_env=env,
    )
    gate = GateServer(agent.settings.gate_socket, agent)
    await gate.start()
    agent.worker_env.update(gate.environment())
    ep = EmulatorControl(tmp_path / "ep")
    manager = ManagerSettings(servers=[nats_server.url], retry_s=0.2, lost_check_s=0.5)
    try:
        async with running_manager(manager) as service, running(agent):

            def seen(*job_ids: str) -> bool:
                view = service.registry.view(SITE, DRONE)
                return view is not None and {p.job_id for p in view.payloads} == set(job_ids)

            await wait_until(lambda: agent.gate_open, 60, "the gate to open")
            for _ in range(600):  # the agent sets the startd's START attribute after the gate
                if (await ep.status())["extras"].get(GATE_ATTRIBUTE):
                    break
                await asyncio.sleep(0.05)
            assert (await ep.offer("21.0", 15.0, exit_code=3))["outcome"] == "started"
            assert (await ep.offer("22.0", 600.0))["outcome"] == "started"
            await wait_until(lambda: seen("21.0", "22.0"), 30, "both payloads at the manager")

            for job_id in ("21.0", "22.0", "99.0"):  # itself, its neighbour, a job never run
                await _hook_job_exit(agent.settings.gate_socket, job_id)
            await wait_until(
                lambda: agent.counters["job_exits_unconfirmed"] == 2,
                30,
                "the startd's listing after the reports",
            )
            assert {p.job_id for p in agent.payloads} == {"21.0", "22.0"}
            assert agent.state is ev.DroneState.BUSY and seen("21.0", "22.0")
            assert agent.counters["job_exit_unknown"] == 1

            # 21.0 really ends: the starter's own JOB_EXIT, and the startd lets it go
            await ep.wait_for("job_exit", job_id="21.0")
            await wait_until(lambda: seen("22.0"), 30, "the real end at the manager")
            view = service.registry.view(SITE, DRONE)
            assert view is not None
            finished = view.event
            assert isinstance(finished, ev.PayloadFinished) and finished.job_id == "21.0"
            assert (finished.how, finished.exit_code) == (ev.PayloadEnd.EXIT, 3)  # the real one
            assert [p.job_id for p in agent.payloads] == ["22.0"]
    finally:
        await gate.close()


async def test_a_flood_of_job_exits_costs_one_listing_of_the_startd(
    tmp_path: Path, nats_server: EmbeddedServer, store: RecordStore
) -> None:
    class Counting(FakeStartd):
        listings = 0

        async def slots(self) -> list[SlotInfo]:
            self.listings += 1
            return await super().slots()

    startd = Counting(slots=2)
    # polled once, when it is ready: every later listing confirms JOB_EXIT reports
    agent = Agent(
        settings(tmp_path, nats_server.url, startd=True, slots=2, poll_s=3600.0), startd=startd
    )
    async with running(agent):
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        for slot, job_id in enumerate(JOBS):
            assert agent.prepare_job(JobStart(job_id, f"slot1_{slot}")).allow
            startd.run_job(slot, job_id)
        before = startd.listings
        for _ in range(500):
            agent.job_exited(JOBS[0], ev.PayloadEnd.EXIT, 0, None)
        await wait_until(
            lambda: agent.counters["job_exits_unconfirmed"] == 1, what="the reports confirmed"
        )
        assert startd.listings == before + 1
        assert {p.job_id for p in agent.payloads} == set(JOBS)
        startd.run_job(0, None)  # it really ends, and its starter reports it
        agent.job_exited(JOBS[0], ev.PayloadEnd.EXIT, 5, None)
        await wait_until(lambda: len(agent.payloads) == 1, what="the end confirmed")
        assert [p.job_id for p in agent.payloads] == [JOBS[1]]
        assert startd.listings == before + 2
