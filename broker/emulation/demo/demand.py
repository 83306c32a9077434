"""A COBalD controller that follows a fixed demand schedule (the demonstration's demand swings)"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import trio
from cobald.daemon import service
from cobald.interfaces import Controller


def demand_at(schedule: Sequence[Sequence[float]], elapsed_s: float) -> float:
    """The demand ``elapsed_s`` seconds after the start of ``schedule``"""
    demand = 0.0
    for at, value in schedule:
        if elapsed_s >= at:
            demand = float(value)
        else:
            break
    return demand


@service(flavour=trio)
class ScheduledDemand(Controller):
    """
    A pipeline element like COBalD's own controllers::

        pipeline:
          - __type__: broker.emulation.demo.demand.ScheduledDemand
            schedule: [[0, 8], [12, 0], [20, 6]]   # [seconds after start, demand]
            start: 1767225600.0                     # epoch seconds; default: when it first runs
            interval: 1
          - !RemoteTardisPoolFactory {...}

    Before ``start`` the demand is 0; from each step on it is that step's value.
    """

    def __init__(
        self,
        target: Any,
        schedule: Sequence[Sequence[float]],
        start: float | None = None,
        interval: float = 1.0,
    ) -> None:
        super().__init__(target=target)
        self.schedule = sorted(([float(at), float(value)] for at, value in schedule))
        self.start = start
        self.interval = interval

    async def run(self) -> None:
        if self.start is None:
            self.start = time.time()
        while True:
            self.target.demand = demand_at(self.schedule, time.time() - self.start)
            await trio.sleep(self.interval)
