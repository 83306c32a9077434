"""
The fleet benchmark's site and overlay: TARDIS adapters that answer from the fleet's plan

Loaded by dotted name from the pool's TARDIS configuration
(``_fleet_site:FleetSite``, ``_fleet_site:FleetOverlay``). Each answer is a lookup in the
plan of ``_fleet_agents.py`` (a bisect in one drone's events): the cost class of the
registry lookups that the decorated adapters answer from, with no batch-system tool behind it.
Stock TARDIS runs on them as they are; the event-driven pool wraps them as it wraps any
adapter, so they answer only what the agents' events do not. Every call is counted.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from typing import Any

from _fleet_agents import SLOTS, Life, Plan
from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.utilities.attributedict import AttributeDict

#: every call to the fake site and overlay, by method name
CALLS: collections.Counter[str] = collections.Counter()


class Fleet:
    """The plan the adapters answer from, and when it started (epoch seconds)"""

    plan: Plan | None = None
    t0: float = 0.0

    @classmethod
    def life(cls, drone: str) -> tuple[Life | None, float]:
        """The drone's life and the time on the plan's clock"""
        assert cls.plan is not None, "set Fleet.plan before the pool runs"
        return cls.plan.lives.get(drone), time.time() - cls.t0


class FleetSite(SiteAdapter):  # type: ignore[misc]
    """A site whose batch jobs run as the plan says"""

    def __init__(self, machine_type: str, site_name: str) -> None:
        self._machine_type = machine_type
        self._site_name = site_name

    async def deploy_resource(self, resource_attributes: AttributeDict) -> AttributeDict:
        CALLS["deploy_resource"] += 1
        return AttributeDict(
            remote_resource_uuid=resource_attributes.drone_uuid,
            resource_status=ResourceStatus.Booting,
        )

    async def resource_status(self, resource_attributes: AttributeDict) -> AttributeDict:
        CALLS["resource_status"] += 1
        life, t = Fleet.life(resource_attributes.drone_uuid)
        if life is None or t >= life.exit:
            status = ResourceStatus.Deleted
        elif t >= life.start:
            status = ResourceStatus.Running
        else:
            status = ResourceStatus.Booting
        return AttributeDict(resource_status=status)

    async def stop_resource(self, resource_attributes: AttributeDict) -> None:
        CALLS["stop_resource"] += 1

    async def terminate_resource(self, resource_attributes: AttributeDict) -> None:
        CALLS["terminate_resource"] += 1

    @contextlib.contextmanager
    def handle_exceptions(self) -> Iterator[None]:
        yield


class FleetOverlay(BatchSystemAdapter):  # type: ignore[misc]
    """An overlay pool whose machines are available, draining and drained as the plan says"""

    async def integrate_machine(self, drone_uuid: str) -> None:
        CALLS["integrate_machine"] += 1

    async def disintegrate_machine(self, drone_uuid: str) -> None:
        CALLS["disintegrate_machine"] += 1

    async def drain_machine(self, drone_uuid: str) -> None:
        CALLS["drain_machine"] += 1

    async def get_machine_status(self, drone_uuid: str) -> MachineStatus:
        CALLS["get_machine_status"] += 1
        life, t = Fleet.life(drone_uuid)
        if life is None or t < life.gate:
            return MachineStatus.NotAvailable
        if t >= life.drained:
            return MachineStatus.Drained
        if t >= life.draining:
            return MachineStatus.Draining
        return MachineStatus.Available

    def _busy(self, drone_uuid: str) -> float:
        life, t = Fleet.life(drone_uuid)
        if life is None:
            return 0.0
        k = life.newest(t)
        return life.events[k][3] / SLOTS if k >= 0 else 0.0

    async def get_allocation(self, drone_uuid: str) -> float:
        CALLS["get_allocation"] += 1
        return self._busy(drone_uuid)

    async def get_utilisation(self, drone_uuid: str) -> float:
        CALLS["get_utilisation"] += 1
        return self._busy(drone_uuid)

    @property
    def machine_meta_data_translation_mapping(self) -> Any:
        return AttributeDict(Cores=1, Memory=1, Disk=1)
