"""
One JSON object per line over a Unix socket: the emulators' little RPC

The emulated local batch system (``lbs.py``) and overlay pool (``overlay.py``)
serve it; the emulated TARDIS adapters (``tardis_adapters.py``) inside the
COBalD daemon are its clients, the way TARDIS's real adapters run
``condor_q``/``condor_status``. A client connects, writes one object and a
newline, reads one object and a newline back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from broker.emulation.execution_point.control import EmulatorUnavailable

log = logging.getLogger("emulation.wire")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

#: largest request or reply, in bytes
MAX_LINE = 16 << 20


async def serve(path: Path, handler: Handler) -> asyncio.Server:
    """Serve ``handler`` on ``path`` (replacing a stale socket file)"""

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
    return await asyncio.start_unix_server(one, path=os.fspath(path), limit=MAX_LINE)


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
    if not line:
        raise EmulatorUnavailable(f"{path}: no reply to {payload.get('op')!r}")
    reply = json.loads(line)
    if not isinstance(reply, dict):
        raise EmulatorUnavailable(f"{path}: bad reply {reply!r}")
    return reply
