"""An emulator's background tasks and socket: what start() begins, close() ends"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from broker.emulation.rpc import Handler, serve


class Tasks:
    """Tasks run beside an emulator's requests, held until they end; :meth:`cancel` ends the rest"""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Service:
    """``handler`` served on ``socket`` (its folder made on :meth:`start`), and :attr:`tasks`"""

    def __init__(self, socket: Path, handler: Handler) -> None:
        self.socket = socket
        self.handler = handler
        self.tasks = Tasks()
        self._server: asyncio.Server | None = None

    async def start(self, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Serve, and run ``loop()`` until :meth:`close`"""
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self._server = await serve(self.socket, self.handler)
        self.tasks.spawn(loop())

    def stop_serving(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        self.stop_serving()
        await self.tasks.cancel()
