"""The gate against hostile local clients: deep nesting, other users, unsafe directories"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from remote_agent.errors import GateError, SpoolError
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
from remote_agent.gate.server import GateServer
from remote_agent.interfaces import GateDecision, JobStart
from remote_agent.private_dir import private_directory
from remote_agent.protocol.events import PayloadEnd
from remote_agent.spool import Spool

NOBODY = 65534


class Recorder:
    """A GateHandler that allows everything and records it"""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.exited: list[str] = []

    def prepare_job(self, job: JobStart) -> GateDecision:
        self.started.append(job.job_id)
        return GateDecision(allow=True)

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        self.exited.append(job_id)

    async def settled(self) -> None:
        return None


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[GateServer, Recorder]]:
    handler = Recorder()
    server = GateServer(tmp_path / "gate" / "gate.sock", handler, request_timeout_s=2.0)
    await server.start()
    yield server, handler
    await server.close()


async def _raw(path: Path, data: bytes) -> GateDecisionReply | GateAck | GateErrorReply:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(data)
    writer.write_eof()
    reply = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return msgspec.msgpack.decode(reply, type=GateDecisionReply | GateAck | GateErrorReply)


def _nested(levels: int) -> bytes:
    """A prepare_job request with ``levels`` of nested arrays in an unknown field"""
    head = msgspec.msgpack.encode({"op": "prepare_job", "v": 1, "job_id": "1.0"})
    # fixmap of 3 entries -> 4 entries, then "x": [[[...]]]
    body = b"\x84" + head[1:] + msgspec.msgpack.encode("x") + b"\x91" * levels + b"\xc0"
    return body


@pytest.mark.parametrize("levels", [1_000, 4_000, 20_000])
async def test_deep_nesting_is_an_error_and_the_gate_keeps_serving(
    served: tuple[GateServer, Recorder], levels: int
) -> None:
    server, handler = served
    data = _nested(levels)
    for _ in range(3):
        reply = await _raw(server.path, data)
        assert isinstance(reply, GateErrorReply)
    assert server.counts["malformed"] + server.counts["oversized"] == 3
    assert handler.started == []
    reply = await asyncio.to_thread(ask, server.path, PrepareJobRequest(job_id="2.0"), 10.0)
    assert reply == GateDecisionReply(allow=True)
    assert handler.started == ["2.0"]


async def test_nesting_that_fits_the_size_limit_is_malformed(
    served: tuple[GateServer, Recorder],
) -> None:
    server, _ = served
    data = _nested(MAX_REQUEST_BYTES - 64)
    assert len(data) <= MAX_REQUEST_BYTES
    reply = await _raw(server.path, data)
    assert isinstance(reply, GateErrorReply)
    assert server.counts["malformed"] == 1


@pytest.mark.parametrize("job_id", ["1.0\n", "1.0\r", "\n", "1.0\x7f", "1.0\x00"])
async def test_job_ids_with_control_characters_are_refused(
    served: tuple[GateServer, Recorder], job_id: str
) -> None:
    server, handler = served
    for request in (
        PrepareJobRequest(job_id=job_id),
        JobExitRequest(job_id=job_id, how=PayloadEnd.EXIT),
    ):
        data = msgspec.msgpack.encode(request)
        reply = await _raw(server.path, data)
        assert isinstance(reply, GateErrorReply), reply
    assert handler.started == [] and handler.exited == []
    assert server.counts["malformed"] == 2


async def test_a_slot_name_with_a_newline_is_refused(served: tuple[GateServer, Recorder]) -> None:
    server, handler = served
    request = PrepareJobRequest(job_id="1.0", slot="slot1\nFake = True")
    reply = await _raw(server.path, msgspec.msgpack.encode(request))
    assert isinstance(reply, GateErrorReply)
    assert handler.started == []


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


#: a client with the standard library only (the venv may not be readable by that user)
_CLIENT = """
import socket, sys
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(10)
    sock.connect(sys.argv[1])
    sock.sendall(bytes.fromhex(sys.argv[2]))
    sock.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
print(data.hex())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="needs root and a system python to run a client as another user",
)
async def test_another_user_is_refused_by_peer_credentials(
    served: tuple[GateServer, Recorder],
) -> None:
    server, handler = served
    # a mistake opened the directory and the socket to everyone: SO_PEERCRED still refuses
    os.chmod(server.path.parent, 0o755)
    os.chmod(server.path, 0o666)
    for parent in Path(server.path).parents:
        if stat.S_IMODE(parent.stat().st_mode) & 0o001 == 0:
            os.chmod(parent, stat.S_IMODE(parent.stat().st_mode) | 0o001)
    request = encode(PrepareJobRequest(job_id="66.0")).hex()
    for _ in range(3):
        done = await asyncio.to_thread(
            subprocess.run,
            ["/usr/bin/python3", "-I", "-c", _CLIENT, str(server.path), request],
            capture_output=True,
            timeout=60,
            preexec_fn=_as_nobody,
            cwd="/",
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        reply = msgspec.msgpack.decode(
            bytes.fromhex(done.stdout.decode().strip()),
            type=GateDecisionReply | GateAck | GateErrorReply,
        )
        assert isinstance(reply, GateErrorReply), reply
        assert f"uid {NOBODY} may not use this gate" in reply.error
    assert handler.started == []
    assert server.counts["peer_refused"] == 3
    # the agent's own user still gets answers
    reply = await asyncio.to_thread(ask, server.path, PrepareJobRequest(job_id="1.0"), 10.0)
    assert reply == GateDecisionReply(allow=True)


async def test_the_own_user_only_by_default(tmp_path: Path) -> None:
    server = GateServer(tmp_path / "g.sock", Recorder(), allowed_uids=[os.geteuid() + 1])
    await server.start()
    try:
        reply = await asyncio.to_thread(ask, server.path, PrepareJobRequest(job_id="1.0"), 10.0)
        assert isinstance(reply, GateErrorReply)
        assert server.counts["peer_refused"] == 1
    finally:
        await server.close()
    assert GateServer(tmp_path / "x.sock", Recorder()).allowed_uids == {os.geteuid(), 0}


def test_new_directories_are_0700_from_the_start(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask nothing is ever wider than 0700
    try:
        private_directory(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_an_existing_readable_directory_is_tightened(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    private_directory(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700


async def test_a_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(GateError, match="writable by group or others"):
        await GateServer(shared / "gate.sock", Recorder()).start()
    with pytest.raises(SpoolError, match="writable by group or others"):
        Spool.open(shared)
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
async def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(GateError, match=f"belongs to uid {NOBODY}"):
        await GateServer(theirs / "gate.sock", Recorder()).start()
    with pytest.raises(SpoolError, match=f"belongs to uid {NOBODY}"):
        Spool.open(theirs)


async def test_the_shared_tmp_directory_is_refused() -> None:
    # 1777: whoever owns it, others may write to it
    with pytest.raises(GateError, match=r"writable by group or others|belongs to uid"):
        await GateServer(Path("/tmp/cobald-remote-test-gate.sock"), Recorder()).start()
