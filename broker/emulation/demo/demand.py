"""
The demonstration's own elements of COBalD's pipeline: a scripted demand, and a recorder of
every change of demand and every drone the pool releases

Its rule: both run inside the real COBalD daemon and change nothing of what COBalD and TARDIS
decide; the recorder passes every demand on unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import trio
from cobald.composite.factory import FactoryPool
from cobald.daemon import service
from cobald.interfaces import Controller, Pool, PoolDecorator

log = logging.getLogger("cobald.runtime.emulation.demand")

#: the :class:`DemandRecorder`'s file in a run's directory
DEMAND_RECORD = "demand.jsonl"


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


def factory_pools(pool: Any) -> Iterator[FactoryPool]:
    """Every ``FactoryPool`` below ``pool``: through composites' children and decorators' targets"""
    stack = [pool]
    while stack:
        node = stack.pop()
        if isinstance(node, FactoryPool):
            yield node
            continue
        children = getattr(node, "children", None)
        if isinstance(children, list):
            stack.extend(children)
        target = getattr(node, "target", None)
        if target is not None:
            stack.append(target)


@service(flavour=trio)
class DemandRecorder(PoolDecorator):
    """
    Where TARDIS's example configuration logs changes (COBalD's ``Logger``), writes them::

        pipeline:
          - !LinearController {low_utilisation: 0.9, high_allocation: 0.9, rate: 1}
          - !Limiter {minimum: 1}
          - __type__: broker.emulation.demo.demand.DemandRecorder
            path: /run/dir/demand.jsonl
          - !RemoteTardisPoolFactory {...}

    One object per line, ``t`` in epoch seconds:

    * ``{"event": "demand", "value", "was", "supply", "utilisation", "allocation"}``: each
      demand set that differs from the pool's demand (``was``), with the pool's state the
      controller decided on;
    * ``{"event": "spawn", "drone"}``: the pool created a drone;
    * ``{"event": "release", "drone", "state"}``: the pool set a drone's demand to 0 (COBalD's
      ``FactoryPool`` releases so); ``state``: TARDIS's state of the drone when it was last
      seen with demand, at most ``interval`` before (``None``: not yet run);
    * ``{"event": "down", "drone"}``: a drone set its own demand to 0 in ``DownState``.

    Drones are looked at every ``interval`` seconds (in COBalD's trio thread, as the pools
    adjust), so ``spawn``, ``release`` and ``down`` are up to ``interval`` late.
    """

    def __init__(self, target: Pool, path: str, interval: float = 0.05) -> None:
        super().__init__(target)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        #: each drone's TARDIS state, by drone, while its demand is above 0
        self._live: dict[str, str] = {}
        self._gone: set[str] = set()

    @property
    def demand(self) -> float:
        return float(self.target.demand)

    @demand.setter
    def demand(self, value: float) -> None:
        was = self.target.demand
        self.target.demand = value
        if value != was:
            self._write(
                "demand",
                value=float(value),
                was=float(was),
                supply=float(self.target.supply),
                utilisation=float(self.target.utilisation),
                allocation=float(self.target.allocation),
            )

    def _write(self, event: str, **fields: Any) -> None:
        try:
            with self.path.open("a", encoding="utf-8") as stream:  # one short write per line
                stream.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
        except OSError:  # the pipeline must not stop for a statistic
            log.exception("cannot record %s", event)

    def look(self) -> None:
        """Record the drones the pools spawned, released or lost since the last look"""
        for pool in factory_pools(self.target):
            for drone in pool.children:
                attributes = getattr(drone, "resource_attributes", None)
                if attributes is None or "drone_uuid" not in attributes:
                    continue
                name = str(attributes["drone_uuid"])
                state = str(getattr(drone, "state", None))  # TARDIS's state, by class name
                if drone.demand > 0:
                    if name not in self._live and name not in self._gone:
                        self._write("spawn", drone=name)
                    self._live[name] = state
                elif name in self._live:
                    seen = self._live.pop(name)
                    self._gone.add(name)
                    if state == "DownState":
                        self._write("down", drone=name)
                    else:
                        self._write("release", drone=name, state=seen)

    async def run(self) -> None:
        while True:
            try:
                self.look()
            except Exception:  # a service that raises ends the daemon
                log.exception("cannot look at the pool's drones")
            await trio.sleep(self.interval)
