"""What a drone's agent says when the broker refuses it, is away at its start, or it ends"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
from nats.js import JetStreamContext
from support.agent import running, settings
from support.waiting import wait_until, wait_until_async

from broker.cli import main
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.protocol.connect import connect

pytestmark = pytest.mark.timeout(120)
DRONE = "site1-00000000aa"
REFUSED = "the broker refused this drone's credentials"


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("remote_agent") and r.levelno >= level
    ]


def attempts(agent: Agent) -> int:
    return agent.publisher.failed_attempts if agent.publisher else 0


class Operator:
    """An operator-mode server with JetStream and ``cobald-remote auth`` around it"""

    def __init__(self, tmp_path: Path, server: EmbeddedServer) -> None:
        self.tmp_path, self.server = tmp_path, server
        self.given = ["--authority", str(tmp_path / "authority.json")]
        self.server_config = tmp_path / "auth.conf"

    def creds(self, drone: str) -> Path:
        path = self.tmp_path / f"{drone}.creds"
        assert main(["auth", "drone", drone, *self.given, "--out", str(path)]) == 0
        return path

    def revoke(self, drone: str) -> None:
        """``auth revoke`` and a reload, as ``systemctl reload`` does it"""
        config = ["--server-config", str(self.server_config)]
        assert main(["auth", "revoke", drone, *self.given, *config]) == 0
        assert self.server.pid is not None
        os.kill(self.server.pid, signal.SIGHUP)

    async def refuses(self, creds: Path) -> bool:
        """Whether the server refuses a connection with ``creds`` (the reload took effect)"""
        try:
            nc = await connect(
                self.server.url,
                user_credentials=str(creds),
                allow_reconnect=False,
                connect_timeout=2,
                error_cb=_quiet,
            )
        except nats.errors.Error as err:
            return "authorization" in str(err).lower()
        except OSError:  # closed before its -ERR was read: ask again
            return False
        await nc.close()
        return False


async def _quiet(_: Exception) -> None:
    """nats-py logs every connection error unless given a callback"""


@pytest.fixture
async def operator(tmp_path: Path) -> AsyncIterator[Operator]:
    given = ["--authority", str(tmp_path / "authority.json")]
    assert main(["auth", "init", *given, "--server-config", str(tmp_path / "auth.conf")]) == 0
    manager = tmp_path / "manager.creds"
    assert main(["auth", "manager", *given, "--out", str(manager)]) == 0
    config = tmp_path / "server.conf"
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth.conf"\n')
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:
        nc = await connect(server.url, user_credentials=str(manager))
        try:
            await provision(nc.jetstream())
        finally:
            await nc.close()
        yield Operator(tmp_path, server)


async def test_a_revoked_agent_says_so_shuts_its_gate_and_drains(
    tmp_path: Path, operator: Operator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="remote_agent")
    creds = operator.creds(DRONE)
    agent = Agent(settings(tmp_path, operator.server.url, DRONE, creds=creds, exit_flush_s=1.0))
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        operator.revoke(DRONE)
        # the drain ends the worker: nothing runs, and no release can reach the drone
        code = await run.exit_code(20)
    assert code == 0 and not agent.gate_open
    said = messages(caplog, logging.ERROR)
    refused = [m for m in said if m.startswith(REFUSED)]
    assert len(refused) == 1, said
    assert "(user authentication revoked)" in refused[0] or "authorization" in refused[0]
    assert "the gate is shut and the drone drains" in refused[0]
    assert "cobald-remote auth drone" in refused[0]
    assert not [m for m in messages(caplog) if m.startswith("disconnected from the broker")]
    # off the bus for good: the agent neither waits for the record nor for its flush
    assert [m for m in messages(caplog) if "unpublished (the broker refused the credentials" in m]
    assert not [m for m in messages(caplog) if m.startswith("gave up to")]


async def test_an_agent_refused_at_connect_says_so_once_and_keeps_its_gate_shut(
    tmp_path: Path, operator: Operator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="remote_agent")
    creds = operator.creds(DRONE)
    operator.revoke(DRONE)
    await wait_until_async(lambda: operator.refuses(creds), what="the reload")
    agent = Agent(settings(tmp_path, operator.server.url, DRONE, creds=creds))
    async with running(agent) as run:
        await wait_until(lambda: attempts(agent) >= 5, what="attempts to connect")
        assert not agent.gate_open
        assert await run.stop() == 128 + 15
    refused = [m for m in messages(caplog, logging.ERROR) if m.startswith(REFUSED)]
    assert len(refused) == 1, refused  # many attempts, one line a minute
    assert "(authorization violation): they were revoked or are invalid" in refused[0]
    assert "the gate stays shut" in refused[0]


async def test_an_agent_started_while_the_broker_is_down_says_its_gate_stays_shut(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="remote_agent")
    await provision(js)
    nats_server.port = int(nats_server.url.rpartition(":")[2])
    await nats_server.stop()
    agent = Agent(settings(tmp_path, nats_server.url, DRONE))
    async with running(agent) as run:
        await wait_until(lambda: attempts(agent) >= 5, what="attempts to connect")
        assert not agent.gate_open
        await nats_server.start()
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        assert await run.stop() == 128 + 15
    said = messages(caplog)
    away = [m for m in said if m.startswith("cannot reach the broker")]
    assert len(away) == 1, away  # many attempts, one line a minute
    assert "the gate stays shut until the agent gets through and claims its record" in away[0]
    through = [m for m in said if m.startswith("connected to ")]
    assert len(through) == 1 and "failed attempts in" in through[0], through
    assert said.index(away[0]) < said.index(through[0])


@pytest.mark.parametrize("broker", ["up", "down"])
async def test_an_agent_that_ends_does_not_say_it_reconnects(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    caplog: pytest.LogCaptureFixture,
    broker: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="remote_agent")
    await provision(js)
    agent = Agent(settings(tmp_path, nats_server.url, DRONE, exit_flush_s=1.0))
    async with running(agent) as run:
        await wait_until(lambda: agent.gate_open, what="the gate to open")
        caplog.clear()
        if broker == "down":
            await nats_server.stop()
            await wait_until(lambda: not agent.publisher or not agent.publisher.connected.is_set())
            caplog.clear()
        assert await run.stop() == 128 + 15
    said = messages(caplog)
    assert not [m for m in said if "reconnect" in m or "disconnected" in m], said
    assert not [m for m in said if "closed the connection" in m], said
    assert said[-1] == "agent exits with 143"
