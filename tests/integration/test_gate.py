"""The gate socket with a plain fake GateHandler: decisions, bad input, the socket file"""

from __future__ import annotations

import asyncio
import socket
import stat
import threading
from pathlib import Path

import msgspec
import pytest
from support.gate import FakeAgent, GateFactory

from remote_agent.errors import GateError, GateUnavailable
from remote_agent.gate.client import ask
from remote_agent.gate.messages import (
    MAX_REQUEST_BYTES,
    GateAck,
    GateDecisionReply,
    GateErrorReply,
    JobExitRequest,
    PrepareJobRequest,
    encode,
)
from remote_agent.gate.paths import GATE_ENV, find_gate_path
from remote_agent.gate.server import GateServer
from remote_agent.interfaces import GATE_CLOSED_STATUS, JobStart
from remote_agent.protocol.events import PayloadEnd


@pytest.fixture
async def gate(start_gate: GateFactory) -> tuple[GateServer, FakeAgent]:
    return await start_gate(request_timeout_s=0.5)


async def _ask(path: Path, request: PrepareJobRequest | JobExitRequest) -> object:
    return await asyncio.to_thread(ask, path, request, 10.0)


async def _raw(path: Path, data: bytes, *, half_close: bool = True) -> object:
    """Send raw bytes, read the reply"""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(data)
    await writer.drain()
    if half_close:
        writer.write_eof()
    reply = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return msgspec.msgpack.decode(reply, type=GateDecisionReply | GateAck | GateErrorReply)


async def test_an_open_gate_allows_and_records_the_job(gate: tuple[GateServer, FakeAgent]) -> None:
    server, agent = gate
    request = PrepareJobRequest(job_id="12.3", slot="slot1_1@wn", owner="alice")
    assert await _ask(server.path, request) == GateDecisionReply(allow=True)
    assert agent.started == [JobStart(job_id="12.3", slot="slot1_1@wn", owner="alice")]
    # the handler ran in the event loop's own thread, not in a worker thread
    assert agent.threads == {threading.get_ident()}
    assert server.counts["allowed"] == 1


async def test_a_closed_gate_refuses_benignly(gate: tuple[GateServer, FakeAgent]) -> None:
    server, agent = gate
    agent.open = False
    reply = await _ask(server.path, PrepareJobRequest(job_id="1.0"))
    assert reply == GateDecisionReply(
        allow=False, status_code=GATE_CLOSED_STATUS, message="drone is draining"
    )
    # a refusal code that would hold the job is never passed on
    agent.status_code = 190
    reply = await _ask(server.path, PrepareJobRequest(job_id="1.1"))
    assert isinstance(reply, GateDecisionReply)
    assert reply.status_code == GATE_CLOSED_STATUS
    assert server.counts["refused"] == 2


async def test_job_exit_is_acknowledged(gate: tuple[GateServer, FakeAgent]) -> None:
    server, agent = gate
    request = JobExitRequest(job_id="1.0", how=PayloadEnd.EVICT, exit_code=-9, duration_s=3.5)
    assert await _ask(server.path, request) == GateAck()
    assert agent.exited == [("1.0", PayloadEnd.EVICT, -9, 3.5)]


@pytest.mark.parametrize(
    ("data", "counter"),
    [
        (b"\xc1 not msgpack at all", "malformed"),
        (b"", "malformed"),
        (msgspec.msgpack.encode({"op": "prepare_job"}), "malformed"),  # no job_id
        (msgspec.msgpack.encode({"op": "prepare_job", "job_id": 12}), "malformed"),
        (msgspec.msgpack.encode({"op": "start_anyway", "job_id": "1.0"}), "malformed"),
        (msgspec.msgpack.encode({"op": "prepare_job", "job_id": "1.0", "v": 99}), "malformed"),
        (msgspec.msgpack.encode({"op": "job_exit", "job_id": "1.0", "how": "x"}), "malformed"),
        (msgspec.msgpack.encode({"op": "prepare_job", "job_id": "a\nb"}), "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (b"\x00" * (MAX_REQUEST_BYTES + 1), "oversized"),
    ],
)
async def test_bad_requests_get_an_error_and_change_nothing(
    gate: tuple[GateServer, FakeAgent], data: bytes, counter: str
) -> None:
    server, agent = gate
    reply = await _raw(server.path, data)
    assert isinstance(reply, GateErrorReply)
    assert reply.error
    assert agent.started == [] and agent.exited == []
    assert server.counts[counter] == 1
    assert server.counts["prepare_job"] == server.counts["job_exit"] == 0


async def test_unknown_version_is_named_in_the_error(gate: tuple[GateServer, FakeAgent]) -> None:
    server, _ = gate
    data = msgspec.msgpack.encode({"op": "prepare_job", "job_id": "1.0", "v": 2})
    reply = await _raw(server.path, data)
    assert isinstance(reply, GateErrorReply)
    assert "version 2" in reply.error


async def test_a_request_that_never_ends_times_out(gate: tuple[GateServer, FakeAgent]) -> None:
    server, agent = gate
    reply = await _raw(server.path, encode(PrepareJobRequest(job_id="1.0")), half_close=False)
    assert isinstance(reply, GateErrorReply)
    assert "within" in reply.error
    assert agent.started == []
    assert server.counts["timeout"] == 1


async def test_a_failing_agent_answers_with_an_error(gate: tuple[GateServer, FakeAgent]) -> None:
    server, agent = gate
    agent.fail = True
    reply = await _ask(server.path, PrepareJobRequest(job_id="1.0"))
    assert isinstance(reply, GateErrorReply)
    assert "bookkeeping broke" in reply.error
    assert server.counts["handler_error"] == 1


async def test_many_hooks_at_once(gate: tuple[GateServer, FakeAgent]) -> None:
    server, agent = gate
    replies = await asyncio.gather(
        *(_ask(server.path, PrepareJobRequest(job_id=f"{n}.0")) for n in range(20))
    )
    assert all(reply == GateDecisionReply(allow=True) for reply in replies)
    assert sorted(job.job_id for job in agent.started) == sorted(f"{n}.0" for n in range(20))


async def test_the_socket_file_is_private_and_removed(tmp_path: Path) -> None:
    server = GateServer(tmp_path / "sub" / "deeper" / "gate.sock", FakeAgent())
    await server.start()
    info = server.path.stat()
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    for directory in (server.path.parent, server.path.parent.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert server.environment()[GATE_ENV] == str(server.path)
    await server.close()
    assert not server.path.exists()


async def test_a_stale_socket_is_replaced_and_a_live_one_kept(tmp_path: Path) -> None:
    path = tmp_path / "gate.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a killed agent leaves
    first = GateServer(path, FakeAgent())
    await first.start()
    second = GateServer(path, FakeAgent())
    with pytest.raises(GateError, match="already serves"):
        await second.start()
    assert await _ask(path, PrepareJobRequest(job_id="1.0")) == GateDecisionReply(allow=True)
    await first.close()


async def test_paths_that_cannot_be_a_gate(tmp_path: Path) -> None:
    regular = tmp_path / "not-a-socket"
    regular.write_text("keep me")
    with pytest.raises(GateError, match="not a socket"):
        await GateServer(regular, FakeAgent()).start()
    assert regular.read_text() == "keep me"
    long_path = tmp_path / ("x" * 120) / "gate.sock"
    with pytest.raises(GateError, match="longer than"):
        await GateServer(long_path, FakeAgent()).start()


async def test_nobody_listening_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(GateUnavailable):
        await _ask(tmp_path / "nobody.sock", PrepareJobRequest(job_id="1.0"))


def test_hooks_find_the_gate_only_through_their_environment() -> None:
    assert find_gate_path({GATE_ENV: "/elsewhere.sock"}) == Path("/elsewhere.sock")
    assert find_gate_path({}) is None
