"""The agent through broker outages, a lost connection, and its own crash"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from support.agent import NS, SITE, read_events, running, settings
from support.processes import CLI, pid_exists, start_process
from support.servers import TcpProxy
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.interfaces import JobStart
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore
from remote_agent.spool import Spool

DRONE = "site1-00000000aa"


def _check_stream(events: list[tuple[str, ev.AnyEvent]]) -> None:
    """No id twice, every id the header too, and per incarnation: contiguous, in order"""
    ids = [msg_id for msg_id, _ in events]
    assert len(ids) == len(set(ids)), "an event was stored twice"
    assert all(msg_id == event.id for msg_id, event in events)
    seqs = [event.seq for _, event in events]
    assert seqs == sorted(seqs), "events were stored out of order"
    by_incarnation: dict[str, list[int]] = {}
    for _, event in events:
        by_incarnation.setdefault(event.incarnation, []).append(event.seq)
    for incarnation_seqs in by_incarnation.values():
        assert incarnation_seqs == list(range(incarnation_seqs[0], incarnation_seqs[-1] + 1)), (
            "an event was lost"
        )


async def _restart_after(server: EmbeddedServer, down_s: float, spool: Spool) -> int:
    """
    Stop the server, keep it down for ``down_s``, start it on the same port and store

    :returns: how many events waited in ``spool`` just before the restart (once the
        server is back the agent may have caught up before the caller looks)
    """
    server.port = int(server.url.rpartition(":")[2])
    await server.stop()
    await asyncio.sleep(down_s)
    waiting = len(spool)
    await server.start()
    assert server.url.endswith(f":{server.port}")
    return waiting


async def test_broker_restart_loses_and_duplicates_nothing(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await provision(js)
    agent = Agent(settings(tmp_path, nats_server.url, DRONE, heartbeat_s=0.02))
    caplog.set_level(logging.WARNING, "remote_agent.connection")
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        publisher = agent.publisher
        assert publisher is not None
        waiting: list[int] = []
        for target in (10, 20):
            await wait_until(lambda n=target: publisher.published > n, what="heartbeats")
            waiting.append(await _restart_after(nats_server, 0.5, publisher.spool))
            await wait_until(lambda: not len(publisher.spool), what="the spool to catch up")
        for i in range(5):  # payloads across the outages
            assert agent.prepare_job(JobStart(f"{i}.0")).allow
        assert await run.stop() == 128 + 15
    assert min(waiting) >= 5, "no events waited in the spool: the outage was not exercised"
    said = [r.getMessage() for r in caplog.records if r.name == "remote_agent.connection"]
    errors = [line for line in said if "(errors so far: " in line]
    assert errors and all(line.startswith("nats: ") for line in errors), said
    assert not any("nats: nats:" in line for line in said), said
    events = await read_events(js, DRONE)
    _check_stream(events)
    assert {e.incarnation for _, e in events} == {agent.incarnation}
    kinds = [ev.kind_of(type(e)) for _, e in events]
    assert kinds[0] == "agent_started" and kinds[-2:] == ["agent_exiting", "heartbeat"]
    assert kinds.count("payload_started") == 5


async def test_drain_intent_written_while_disconnected_is_acted_upon(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    store = await RecordStore.open(js, NS)
    proxy = TcpProxy(int(nats_server.url.rpartition(":")[2]))
    await proxy.start()
    try:
        agent = Agent(settings(tmp_path, proxy.url, DRONE))
        async with running(agent) as run:
            await wait_until(lambda: agent.gate_open, what="the gate to open")
            publisher = agent.publisher
            assert publisher is not None
            await proxy.cut()
            await wait_until(lambda: not publisher.connected.is_set(), what="the disconnect")
            now = ev.utcnow()
            intent = ev.DrainIntent(
                deadline=now + dt.timedelta(minutes=10),
                reason="demand dropped",
                request_id="lost-command",
                requested_at=now,
            )
            drained = await store.request_drain(SITE, DRONE, intent)
            assert drained.record.phase is ev.RecordPhase.DRAINING
            await asyncio.sleep(0.3)
            assert agent.gate_open  # it cannot know yet
            await proxy.restore()
            # on reconnect the agent re-reads its record, closes the gate and drains
            assert await run.exit_code() == 0
    finally:
        await proxy.close()
    record = await store.read(SITE, DRONE)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINED
    events = [e for _, e in await read_events(js, DRONE)]
    accepted = [e for e in events if isinstance(e, ev.DrainAccepted)]
    assert len(accepted) == 1 and accepted[0].intent.request_id == "lost-command"


async def _agent_process(
    url: str, spool: Path, pid_file: Path, heartbeat_s: float
) -> asyncio.subprocess.Process:
    worker = f"echo $$ > {pid_file}; exec sleep 1000"
    return await start_process(
        *CLI,
        "agent",
        "run",
        "--no-startd",
        "--url",
        url,
        "--drone",
        DRONE,
        "--spool-dir",
        str(spool),
        "--heartbeat",
        str(heartbeat_s),
        "--log-level",
        "warning",
        "--",
        "sh",
        "-c",
        worker,
        env={**os.environ, "COBALD_REMOTE_RECONNECT_WAIT_S": "0.1"},
    )


async def _kill_pid_in(pid_file: Path) -> None:
    pid = int(pid_file.read_text())  # noqa: ASYNC240 (a few bytes, in a test)
    os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: not pid_exists(pid), what="the orphaned worker to go")


@pytest.mark.timeout(60)
async def test_killed_agent_resends_its_spool_after_a_restart(
    tmp_path: Path, nats_server: EmbeddedServer
) -> None:
    async with await nats.connect(nats_server.url) as nc:
        await provision(nc.jetstream())
    url = nats_server.url
    nats_server.port = int(url.rpartition(":")[2])
    await nats_server.stop()  # the broker is down while the first agent runs
    spool_dir, pid_file = tmp_path / "spool", tmp_path / "worker.pid"

    first = await _agent_process(url, spool_dir, pid_file, heartbeat_s=0.05)
    try:
        await wait_until(pid_file.exists, timeout_s=30, what="the worker")
        await asyncio.sleep(1.0)  # heartbeats pile up in the spool
    finally:
        first.kill()  # SIGKILL: no chance to clean up
        await first.wait()
    await _kill_pid_in(pid_file)
    with Spool.open(spool_dir) as spool:
        left = [entry.id for entry in spool]
    assert len(left) >= 5

    await nats_server.start()
    pid_file.unlink()
    second = await _agent_process(url, spool_dir, pid_file, heartbeat_s=3600)
    try:
        await wait_until(pid_file.exists, timeout_s=30, what="the second worker")
        async with await nats.connect(url) as nc:
            js = nc.jetstream()

            async def stored() -> list[tuple[str, ev.AnyEvent]]:
                return await read_events(js, DRONE)

            for _ in range(300):
                events = await stored()
                if {i for i, _ in events} >= set(left) and len(
                    {e.incarnation for _, e in events}
                ) == 2:
                    break
                await asyncio.sleep(0.05)
            # a notice of the drone's end: the agent drains and ends its worker itself
            second.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(second.wait(), 30) == 0
            events = await stored()
    finally:
        if second.returncode is None:
            second.kill()
            await second.wait()
        if pid_file.exists():
            with_pid = int(pid_file.read_text())
            if pid_exists(with_pid):
                os.kill(with_pid, signal.SIGKILL)
    _check_stream(events)
    ids = [i for i, _ in events]
    assert ids[: len(left)] == left  # the first agent's events first, in their order
    first_incarnation, second_incarnation = events[0][1].incarnation, events[-1][1].incarnation
    assert first_incarnation != second_incarnation
    later = [e for _, e in events if e.incarnation == second_incarnation]
    assert later[0].seq > events[len(left) - 1][1].seq  # seq continues above the spool
    assert [ev.kind_of(type(e)) for e in later][-2:] == ["agent_exiting", "heartbeat"]
    with Spool.open(spool_dir) as spool:
        assert len(spool) == 0


@pytest.mark.parametrize("step", range(16))
async def test_cancelled_while_flushing_its_last_events_it_still_ends(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, step: int
) -> None:
    """
    Cancelled (Ctrl-C, the event loop ending) while it publishes its last events at exit,
    the agent still ends, whatever its publisher was doing when the cancellation came

    Found by the schedule test (schedule 171): the task group cancels its publisher once, and
    nats-py can swallow that inside a publish; before the fix a cancellation in the exit
    flush hung the agent for good. Each step cancels at another moment of the flush.
    """
    await provision(js)
    agent = Agent(settings(tmp_path, nats_server.url, DRONE, heartbeat_s=0.0005, exit_flush_s=60))
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        await asyncio.sleep(0.3)  # a spool of heartbeats to flush
        agent.request_stop()
        await wait_until(lambda: agent.snapshot().state is ev.DroneState.EXITING, what="exiting")
        await asyncio.sleep(step * 0.0007)
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # or it had finished already
            await asyncio.wait_for(asyncio.shield(run.task), 20)
        assert run.task.done(), "the agent hung after a cancellation during its exit flush"
