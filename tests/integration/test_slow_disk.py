"""
An agent on a scratch disk whose fsync takes 1 s: the gate answers within the hook's
budget, heartbeats keep going, the fsync stays off the event loop, and what the gate
confirmed is in the spool after a SIGKILL
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from support.agent import read_events, running, settings
from support.processes import start_process
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent import spool_disk
from remote_agent.agent import Agent
from remote_agent.gate.client import ask
from remote_agent.gate.messages import AnyGateReply, GateDecisionReply, PrepareJobRequest
from remote_agent.gate.server import GateServer
from remote_agent.hooks import DEFAULT_TIMEOUT_S
from remote_agent.protocol import events as ev
from remote_agent.spool import Spool

DRONE = "site1-00000000fd"
SLOW_FSYNC_S = 1.0
#: the agent, started with its spool's fsync slowed down to ``SLOW_FSYNC_S``
SLOW_AGENT = (
    sys.executable,
    "-c",
    "import os, sys, time\n"
    "from remote_agent import spool_disk\n"
    "def slow(fd): time.sleep(float(os.environ['SLOW_FSYNC_S'])); os.fsync(fd)\n"
    "spool_disk.fsync = slow\n"
    "from broker.cli import main\n"
    "sys.exit(main())\n",
)
#: the threads the slowed fsync ran in
FSYNC_THREADS: set[int] = set()


def _slow_fsync(fd: int) -> None:
    FSYNC_THREADS.add(threading.get_ident())
    time.sleep(SLOW_FSYNC_S)
    os.fsync(fd)


async def _start(path: Path, job_id: str) -> AnyGateReply:
    """
    A start hook's question, asked from a thread as the hook asks it

    With the hook's own budget: :func:`ask` raises ``GateUnavailable`` when no
    answer comes within ``DEFAULT_TIMEOUT_S``.
    """
    request = PrepareJobRequest(job_id=job_id, slot="slot1_1")
    return await asyncio.to_thread(ask, path, request, DEFAULT_TIMEOUT_S)


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_disk, "fsync", _slow_fsync)


@pytest.fixture
async def gate_agent(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext, slow_disk: None
) -> AsyncIterator[tuple[Agent, GateServer]]:
    await provision(js)
    agent = Agent(settings(tmp_path, nats_server.url, DRONE, heartbeat_s=0.05))
    gate = GateServer(agent.settings.gate_socket, agent)
    await gate.start()
    try:
        async with running(agent):
            await wait_until(lambda: agent.gate_open, timeout_s=20, what="the gate to open")
            yield agent, gate
    finally:
        await gate.close()


@pytest.mark.timeout(90)
async def test_the_gate_answers_within_its_budget_while_fsync_takes_a_second(
    gate_agent: tuple[Agent, GateServer], js: JetStreamContext
) -> None:
    agent, gate = gate_agent
    before = len(await read_events(js, DRONE))
    FSYNC_THREADS.clear()
    # each answer within the hook's budget (ask raises otherwise), one after another
    # and two at once, while every fsync takes a second
    answers = [await _start(gate.path, f"{n}.0") for n in range(3)]
    together = await asyncio.gather(*(_start(gate.path, f"{n}.1") for n in range(2)))
    for reply in [*answers, *together]:
        assert isinstance(reply, GateDecisionReply) and reply.allow
    # the fsyncs ran, and never on the event loop's thread
    assert FSYNC_THREADS and threading.get_ident() not in FSYNC_THREADS
    events = [e for _, e in await read_events(js, DRONE)]
    assert len(events) - before >= 5  # heartbeats kept going to the broker meanwhile
    assert sum(isinstance(e, ev.Heartbeat) for e in events[before:]) >= 1
    assert agent.emitter.spool is not None and agent.emitter.spool.syncs >= 5


@pytest.mark.timeout(90)
async def test_a_confirmed_start_survives_a_sigkill_on_a_slow_disk(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    spool_dir, gate_path = tmp_path / "spool", tmp_path / "gate.sock"
    agent = await start_process(
        *SLOW_AGENT,
        "agent",
        "run",
        "--no-startd",
        "--url",
        nats_server.url,
        "--drone",
        DRONE,
        "--spool-dir",
        str(spool_dir),
        "--gate-socket",
        str(gate_path),
        "--heartbeat",
        "0.2",
        "--log-level",
        "warning",
        "--",
        "sleep",
        "1000",
        env={
            **os.environ,
            "SLOW_FSYNC_S": str(SLOW_FSYNC_S),
            "COBALD_REMOTE_RECONNECT_WAIT_S": "0.1",
        },
    )
    try:
        await wait_until(
            lambda: gate_path.exists() or agent.returncode is not None,
            timeout_s=30,
            what="the gate socket",
        )
        assert agent.returncode is None
        for _ in range(200):  # the gate opens once the agent has told the broker it runs
            reply = await _start(gate_path, "warmup.0")
            if isinstance(reply, GateDecisionReply) and reply.allow:
                break
            await asyncio.sleep(0.1)
        await nats_server.stop()  # from now on events stay in the spool
        reply = await _start(gate_path, "7.0")  # within the hook's budget
        agent.send_signal(signal.SIGKILL)  # no chance to write anything more
        await agent.wait()
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    assert isinstance(reply, GateDecisionReply) and reply.allow
    with Spool.open(spool_dir) as spool:
        started = [ev.decode_event(e.data) for e in spool if e.kind == "payload_started"]
    assert "7.0" in {e.job_id for e in started if isinstance(e, ev.PayloadStarted)}
