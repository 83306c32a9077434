"""The drained agent ends its job: its worker waits ``end_grace_s`` only for a startd that exits"""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext
from support.agent import FakeStartd, command, drain, kinds, running, settings
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.interfaces import DrainResult
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore

DRONE = "site1-0123456789"


class _DrainedByAnother(FakeStartd):
    """A startd drained by another without exit on completion: it refuses the agent's drain"""

    async def drain(self, reason: str, *, fast: bool = False) -> DrainResult:
        self.calls.append(("drain", fast))
        return DrainResult(accepted=False, detail="the startd is already draining (10001)")


async def test_a_refused_drain_ends_the_worker_without_the_grace(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    nc: Client,
    js: JetStreamContext,
    store: RecordStore,
) -> None:
    startd = _DrainedByAnother()
    # the worker never exits by itself, and the grace outlasts the test's wait many times over
    agent = Agent(
        settings(tmp_path, nats_server.url, startd=True, end_grace_s=3600.0), startd=startd
    )
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        reply = await command(nc, drain(DRONE))
        assert isinstance(reply, ev.Reply) and reply.outcome is ev.Outcome.DRAIN_ACCEPTED
        assert await run.exit_code() == 0  # terminated as planned: "drained"
    assert ("drain", False) in startd.calls
    ending = ["drained", "worker_exited", "agent_exiting", "heartbeat"]
    assert (await kinds(js, DRONE))[-4:] == ending
