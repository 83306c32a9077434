"""The manager inside COBalD for the TARDIS tests: :class:`RemoteBus` services, TARDIS's states"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from broker.tardis_adapter import BusConfig, RemoteBus

BusFactory = Callable[..., Awaitable[RemoteBus]]


@contextlib.asynccontextmanager
async def running_buses(url: str) -> AsyncIterator[BusFactory]:
    """Start :class:`RemoteBus` services on ``url`` as COBalD would run them; stopped at the end"""
    running: list[tuple[RemoteBus, asyncio.Task[None]]] = []

    async def make(**settings: Any) -> RemoteBus:
        config = BusConfig.from_mapping({"servers": url, **settings})
        bus = RemoteBus(config, register=False)
        task = asyncio.create_task(bus.run())
        running.append((bus, task))
        assert await bus.wait_ready(30), "the bus did not connect"
        return bus

    try:
        yield make
    finally:
        for bus, task in running:
            bus.stop()
            await asyncio.wait_for(task, 30)


class Transitions:
    """A TARDIS plugin recording state names"""

    def __init__(self) -> None:
        self.states: list[str] = []

    async def notify(self, state: Any, resource_attributes: Any) -> None:
        self.states.append(str(state))
