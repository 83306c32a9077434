"""
The emulators' RPC: one JSON object per line over a Unix socket, one reply line

Its rule: every emulator socket and every client of one (tests, demo, fake ``condor_*``
tools, emulated TARDIS adapters) speaks it through this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from broker.emulation.errors import EmulatorUnavailable

log = logging.getLogger("emulation.wire")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

#: largest request or reply, in bytes
MAX_LINE = 16 << 20


async def serve(path: Path, handler: Handler, *, limit: int = MAX_LINE) -> asyncio.Server:
    """Serve ``handler`` on ``path`` (replacing a stale socket file); ``limit``: longest request"""

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = json.loads(await reader.readline())
                if not isinstance(request, dict):
                    raise ValueError("request is not an object")
                reply = await handler(request)
            except (ValueError, KeyError, TypeError) as err:
                reply = {"ok": False, "error": f"bad request: {err}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("emulator request failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(one, path=os.fspath(path), limit=limit)


def _reply(path: Path | str, line: bytes, op: object) -> dict[str, Any]:
    if not line:
        raise EmulatorUnavailable(f"{path}: no reply to {op!r}")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as err:
        raise EmulatorUnavailable(f"{path}: bad reply {line[:200]!r}") from err
    if not isinstance(reply, dict):
        raise EmulatorUnavailable(f"{path}: bad reply {reply!r}")
    return reply


async def request(
    path: Path | str, payload: dict[str, Any], timeout_s: float = 30.0
) -> dict[str, Any]:
    """
    One request and its reply

    :raises EmulatorUnavailable: nobody answers on ``path`` within ``timeout_s``
    """
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(os.fspath(path), limit=MAX_LINE)
            try:
                writer.write(json.dumps(payload).encode() + b"\n")
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError) as err:
        raise EmulatorUnavailable(f"{path}: {err!r}") from err
    return _reply(path, line, payload.get("op"))


def request_sync(
    path: Path | str, payload: dict[str, Any], timeout_s: float = 20.0
) -> dict[str, Any]:
    """
    One request, blocking (for the fake tools)

    :raises EmulatorUnavailable: no socket, nobody listening, or no answer in time
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(os.fspath(path))
            sock.sendall(json.dumps(payload).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as err:
        raise EmulatorUnavailable(f"{path}: {err!r}") from err
    return _reply(path, data, payload.get("op"))
