"""Fixtures shared by every test: a real nats-server on a random loopback port"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from broker.server.embedded import EmbeddedServer


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    """
    A nats-server with JetStream, started by the product's own code

    It binds ``-a 127.0.0.1 -p -1`` and is stopped by its PID at teardown.
    """
    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def nc(nats_server: EmbeddedServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    yield client
    await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()
