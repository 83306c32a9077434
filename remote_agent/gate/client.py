"""
The hook's side of the gate: one blocking request and its reply

The hook path imports neither asyncio nor nats-py: a hook runs before every payload.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import msgspec

from remote_agent.errors import GateUnavailable
from remote_agent.gate.messages import (
    MAX_REPLY_BYTES,
    AnyGateReply,
    AnyGateRequest,
    decode_reply,
    encode,
)


def ask(path: Path, request: AnyGateRequest, timeout_s: float) -> AnyGateReply:
    """
    Send one request to the gate at ``path`` and wait at most ``timeout_s`` for the reply

    Blocking on purpose (see the module doc).

    :raises GateUnavailable: no socket, nobody listening, timeout, or a reply
        that does not decode
    """
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {timeout_s:g}s")
        return left

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(remaining())
            sock.connect(os.fspath(path))
            sock.settimeout(remaining())
            sock.sendall(encode(request))
            sock.shutdown(socket.SHUT_WR)
            chunks: list[bytes] = []
            size = 0
            while True:
                sock.settimeout(remaining())
                chunk = sock.recv(MAX_REPLY_BYTES + 1)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise GateUnavailable(f"reply from {path} larger than {MAX_REPLY_BYTES} bytes")
    except (OSError, TimeoutError) as err:
        raise GateUnavailable(f"cannot ask the agent at {path}: {err}") from err
    try:
        return decode_reply(b"".join(chunks))
    except (msgspec.DecodeError, RecursionError) as err:
        raise GateUnavailable(f"invalid reply from {path}: {err}") from err
