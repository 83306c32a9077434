"""
A cluster whose record bucket loses its leader: a drain waits out the election

While a stream has no leader, no server subscribes to its subjects, so a write to the
bucket gets no responders (nats-py: ``NoStreamResponseError``) until a new leader is
elected; the manager's compare-and-set retries it (``remote_agent/protocol/transient.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.agent import running
from support.agent import settings as agent_settings
from support.manager import running_manager
from support.servers import provision_cluster
from support.waiting import wait_until

from broker.manager.outcomes import CommandOutcome, DrainOutcome, DrainResult
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace

SITE = "site1"
DRONE = "site1-00000000c1"
CONTROL_LOG = "cobald.runtime.cobald_remote.control"


async def record_leader(url: str) -> str:
    """The node that leads the record bucket's stream"""
    nc = await connect(url)
    try:
        info = await nc.jetstream(timeout=5).stream_info(Namespace().record_stream)
    finally:
        await close(nc)
    assert info.cluster is not None and info.cluster.leader is not None
    return info.cluster.leader


@contextlib.asynccontextmanager
async def drone_up(
    tmp_path: Path, urls: list[str]
) -> AsyncIterator[tuple[ManagerService, asyncio.Task[int]]]:
    """The manager and one agent, both connected to ``urls`` only, the drone claimed and idle"""
    manager = ManagerSettings(servers=urls, retry_s=0.2, lost_check_s=0.5)
    agent = Agent(replace(agent_settings(tmp_path, urls[0], DRONE), servers=tuple(urls)))
    async with running_manager(manager) as service, running(agent) as run:
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, DRONE)) is not None
                and view.phase is ev.RecordPhase.UP
                and view.state is ev.DroneState.IDLE
            ),
            60,
            "the drone's claim and events at the manager",
        )
        yield service, run.task


async def drained_in_full(service: ManagerService, drain: asyncio.Future[DrainResult]) -> None:
    """The drain wrote its intent and its command reached the agent, which drained"""
    result = await drain
    assert result.outcome in (DrainOutcome.ACCEPTED, DrainOutcome.DRAINED), result
    assert result.phase is ev.RecordPhase.DRAINING, result
    assert result.command is not None and result.command.outcome is CommandOutcome.ANSWERED
    assert service.control is not None
    stored = await service.control.store.read(SITE, DRONE)
    assert stored is not None and stored.record.drain == result.intent


@pytest.mark.timeout(240)
async def test_a_drain_right_after_the_record_leader_died_is_recorded_and_sent(
    cluster: dict[str, EmbeddedServer], tmp_path: Path
) -> None:
    await provision_cluster([node.url for node in cluster.values()])
    leader = await record_leader(cluster["n1"].url)
    # the manager and the agent are on the other nodes: the leader's death is the
    # bucket's alone, not their connections'
    urls = [node.url for name, node in cluster.items() if name != leader]
    async with drone_up(tmp_path, urls) as (service, agent):
        assert service.control is not None
        leader = await record_leader(urls[0])  # it may have moved meanwhile
        await cluster[leader].kill()
        drain = asyncio.ensure_future(service.control.drain(SITE, DRONE, reason="leader lost"))
        await drained_in_full(service, drain)
        assert await asyncio.wait_for(asyncio.shield(agent), 60) == 0


@pytest.mark.timeout(240)
async def test_a_drain_without_a_quorum_is_written_once_a_node_returns(
    cluster: dict[str, EmbeddedServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of three nodes down: every write fails until one of them is back"""
    await provision_cluster([node.url for node in cluster.values()])
    leader = await record_leader(cluster["n1"].url)
    survivor, other = (name for name in cluster if name != leader)
    async with drone_up(tmp_path, [cluster[survivor].url]) as (service, agent):
        assert service.control is not None
        for name in (leader, other):
            await cluster[name].kill()
        with caplog.at_level(logging.WARNING, CONTROL_LOG):
            drain = asyncio.ensure_future(service.control.drain(SITE, DRONE, reason="no quorum"))
            await wait_until(
                lambda: any(
                    "write of" in r.message and r.name == CONTROL_LOG for r in caplog.records
                ),
                60,
                "a write of the record that failed",
            )
            assert not drain.done()
            await cluster[other].start()
            await drained_in_full(service, drain)
        assert await asyncio.wait_for(asyncio.shield(agent), 60) == 0
