"""
remote_agent.protocol.connect: a failed or cancelled connect, or a cancelled close, leaves no
socket open

An open socket left to the garbage collector fails whichever later test is
running when it is freed (ResourceWarning, and filterwarnings = error), and
in the agent and the manager it is a file descriptor lost per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import warnings
from pathlib import Path

import nats.errors
import pytest

from broker.server.embedded import EmbeddedServer
from remote_agent.protocol.connect import close, connect

pytestmark = pytest.mark.timeout(60)


def open_sockets() -> int:
    """How many sockets this process has open (Linux: /proc/self/fd)"""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own descriptor, closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def unclosed_sockets() -> list[str]:
    """The ResourceWarnings of sockets and transports that only the collector freed"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_refused_credentials_leave_no_socket_open(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats", extra_args=["--user", "manager", "--pass", "right"])
    await server.start()
    try:
        assert unclosed_sockets() == []
        before = open_sockets()
        url = server.url.replace("nats://", "nats://manager:wrong@")
        with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
            await connect(url, connect_timeout=2, allow_reconnect=False)
        # counted before any collection: the raised error's traceback still
        # references the client, so only an explicit close frees its socket
        assert open_sockets() == before
        assert unclosed_sockets() == []
        # the right password still connects through the same helper
        nc = await connect(server.url.replace("nats://", "nats://manager:right@"))
        assert nc.is_connected
        await nc.close()
    finally:
        await server.stop()


async def test_a_connect_cancelled_before_the_server_speaks_closes_its_socket() -> None:
    """A listener that never sends INFO: the connect waits until it is cancelled"""
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await accepted.put(reader)

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        attempt = asyncio.create_task(
            connect(f"nats://127.0.0.1:{port}", connect_timeout=30, max_reconnect_attempts=-1)
        )
        reader = await asyncio.wait_for(accepted.get(), 10)
        await asyncio.sleep(0.05)  # the client now awaits INFO
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        # the client closed its end: the listener reads end-of-file, not a timeout
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert unclosed_sockets() == []
    finally:
        for writer in writers:
            writer.close()
        listener.close()
        await listener.wait_closed()


@pytest.mark.parametrize("turns", range(1, 9))
async def test_a_close_cancelled_halfway_still_closes_the_socket(
    nats_server: EmbeddedServer, turns: int
) -> None:
    """
    Cancelled ``turns`` turns of the event loop into the close, :func:`close` still
    closes the socket, then raises the cancellation (nats-py's own close, cancelled
    between its flush and the socket's close, leaves the socket to the collector)
    """
    assert unclosed_sockets() == []
    before = open_sockets()
    nc = await connect(nats_server.url)
    await nc.subscribe("anything")
    await nc.publish("anything", b"pending")  # something for the close to flush
    closing = asyncio.create_task(close(nc))
    for _ in range(turns):
        await asyncio.sleep(0)
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):  # or it was done already
        await closing
    assert nc.is_closed
    assert open_sockets() == before
    assert unclosed_sockets() == []
