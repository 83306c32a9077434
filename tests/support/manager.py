"""The manager as COBalD runs it, for the tests"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings


@contextlib.asynccontextmanager
async def running_manager(
    settings: ManagerSettings, registry: Registry | None = None
) -> AsyncIterator[ManagerService]:
    """A :class:`ManagerService` run as COBalD would, ready (rebuilt); stopped at the end"""
    service = ManagerService(settings, registry)
    task = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 30)
        yield service
    finally:
        service.stop()
        await asyncio.wait_for(task, 30)
