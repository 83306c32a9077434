"""Fixtures of the integration tests (a real nats-server; see tests/conftest.py)"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from nats.js import JetStreamContext
from support.gate import FakeAgent, GateFactory
from support.servers import secured_server, three_nodes

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.gate.server import GateServer
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import Namespace

if TYPE_CHECKING:
    from support.buses import BusFactory


@pytest.fixture(autouse=True)
def _collect_garbage_at_teardown() -> Iterator[None]:
    """
    Free what the test left behind before the next test starts

    A socket or transport that a test leaves open is freed by the garbage
    collector with a ResourceWarning, which ``filterwarnings = error`` turns
    into a failure of whichever test runs at that moment. Collecting here
    makes it fail the test that left it (about 75 ms per test).
    """
    yield
    gc.collect()


@pytest.fixture
async def stream(js: JetStreamContext) -> JetStreamContext:
    """The test server's JetStream, provisioned as the manager provisions it"""
    await provision(js)
    return js


@pytest.fixture
async def store(stream: JetStreamContext) -> RecordStore:
    """The drone records (KV) of the provisioned server, written as a drone writes them"""
    return await RecordStore.open(stream, Namespace())


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedServer, Path]]:
    """A server in operator mode with JetStream; yields it and the authority file"""
    async with secured_server(tmp_path) as (server, authority_file):
        yield server, authority_file


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, EmbeddedServer]]:
    """Three nodes of the shipped cluster.conf (``n1`` to ``n3``), started; stopped at the end"""
    async with three_nodes(tmp_path) as nodes:
        yield nodes


@pytest.fixture
async def start_gate(tmp_path: Path) -> AsyncIterator[GateFactory]:
    """Gate sockets (``tmp_path / "gate.sock"``) with a fake agent; closed at the end"""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**options: Any) -> tuple[GateServer, FakeAgent]:
            agent = FakeAgent()
            server = GateServer(tmp_path / "gate.sock", agent, **options)
            await server.start()
            stack.push_async_callback(server.close)
            return server, agent

        yield start


@pytest.fixture
async def make_bus(nats_server: EmbeddedServer, js: JetStreamContext) -> AsyncIterator[BusFactory]:
    """Start :class:`RemoteBus` services as COBalD would run them; stopped at the end"""
    from support.buses import running_buses  # imports TARDIS: only the tests that use it

    await provision(js)
    async with running_buses(nats_server.url) as make:
        yield make
