"""The agent's background tasks: each has an owner, and a failing one is logged, not fatal"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine, Iterable
from typing import Any

from remote_agent.agent.status import DroneStatus

log = logging.getLogger("remote_agent.agent")


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], budget_s: float = 10.0) -> None:
    """
    Cancel ``tasks`` and wait until they are done, cancelling again while they run

    Repeated because nats-py swallows a cancellation that arrives while it hands a
    message to its flusher (``Client._flush_pending``): the task then carries on
    until its next await, where the next cancellation lands.
    """
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + budget_s
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    if pending:
        log.error("tasks did not stop: %s", ", ".join(sorted(t.get_name() for t in pending)))


class Tasks:
    """The tasks of one agent run, in its task group (:attr:`group`, set by the run)"""

    def __init__(self, status: DroneStatus, counters: Counter[str], drone: str) -> None:
        self._status = status
        self._counters = counters
        self._drone = drone
        self.group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> set[asyncio.Task[None]]:
        """The tasks started and not done yet"""
        return set(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` as a task; nothing new starts once the agent winds down"""
        if self.group is None or self._status.winding_down:
            coro.close()
            return
        guarded = self._guard(coro, name)
        try:
            task = self.group.create_task(guarded, name=name)
        except RuntimeError:  # the task group is already shutting down: nothing new starts
            guarded.close()
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # a task cancelled before its first step never awaits ``coro``: closed, it goes
        # quietly (a no-op for one that ran)
        task.add_done_callback(lambda _: coro.close())

    async def _guard(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        # a bug in one activity must not take the worker (and its payloads) down
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self._counters["internal_errors"] += 1
            log.exception("%s failed", name, extra={"drone": self._drone})

    async def cancel(self) -> None:
        """Stop every task but the one calling"""
        await stop_tasks(t for t in self._tasks if t is not asyncio.current_task())
