"""Waiting for a condition in the tests: poll it, never sleep a fixed time"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def wait_until(
    condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """
    Poll ``condition`` until it holds (generous timeouts: loaded CI machines)

    :raises AssertionError: if it does not hold within ``timeout_s``
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)


async def wait_until_async(
    condition: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """
    :func:`wait_until` for a condition that must be awaited (a question to a server)

    :raises AssertionError: if it does not hold within ``timeout_s``
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)
