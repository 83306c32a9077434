"""
Fakes for the TARDIS integration tests: plain adapter classes, no mocks

:class:`FakeSite` and :class:`FakeOverlay` are real subclasses of TARDIS's
adapter interfaces with scripted answers, so the decorators wrap them as they
wrap TARDIS's own adapters; :func:`rig` puts a TARDIS drone on them. :class:`FakeControl`
stands in for :class:`broker.manager.control.Control` where a test needs no server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.resources.drone import Drone
from tardis.utilities.attributedict import AttributeDict

from broker.manager.outcomes import DrainOutcome, DrainResult, ReleaseOutcome, ReleaseResult
from broker.manager.registry import Registry
from broker.manager.verdict import Removal, Verdict
from broker.tardis.drone import EventDrone
from broker.tardis_adapter import (
    BusConfig,
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import dedupe_id
from support.buses import Transitions
from support.drones import FakeDrone

SITE_NAME = "Site1"
SITE = "site1"
DRONE = "site1-0123456789"
#: far longer than any test: a state run that happens was woken
LONG_HEARTBEAT_S = 3600


@contextlib.asynccontextmanager
async def drone_running(drone: Any) -> AsyncIterator[asyncio.Task[None]]:
    """A TARDIS drone's state machine (``Drone.run``) running for the block, then cancelled"""
    task = asyncio.create_task(drone.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class FakeSite(SiteAdapter):  # type: ignore[misc]
    """
    A site adapter with scripted job states; ``fail`` is raised by the calls in ``fail_on``

    :attr:`status` is what ``resource_status`` answers (the batch system's view).
    """

    def __init__(
        self,
        machine_type: str = "m1",
        site_name: str = SITE_NAME,
        *,
        fail: Exception | None = None,
        fail_on: frozenset[str] = frozenset(),
        status: ResourceStatus = ResourceStatus.Booting,
        heartbeat_s: int = 1,
    ) -> None:
        self._machine_type = machine_type
        self._site_name = site_name
        self.fail = fail
        self.fail_on = fail_on
        self.status = status
        self.heartbeat_s = heartbeat_s
        self.calls: list[tuple[str, str]] = []
        self.environments: list[dict[str, Any]] = []

    def _call(self, name: str, resource_attributes: Any) -> None:
        self.calls.append((name, str(resource_attributes.get("drone_uuid"))))
        if self.fail is not None and name in self.fail_on:
            raise self.fail

    def called(self, name: str) -> int:
        return sum(1 for call, _ in self.calls if call == name)

    async def deploy_resource(self, resource_attributes: Any) -> Any:
        self._call("deploy_resource", resource_attributes)
        self.environments.append(
            self.drone_environment(
                resource_attributes["drone_uuid"],
                resource_attributes["obs_machine_meta_data_translation_mapping"],
            )
        )
        return AttributeDict(remote_resource_uuid="1.0", resource_status=self.status)

    async def resource_status(self, resource_attributes: Any) -> Any:
        self._call("resource_status", resource_attributes)
        return AttributeDict(resource_status=self.status)

    async def stop_resource(self, resource_attributes: Any) -> None:
        self._call("stop_resource", resource_attributes)
        self.status = ResourceStatus.Stopped

    async def terminate_resource(self, resource_attributes: Any) -> None:
        self._call("terminate_resource", resource_attributes)
        self.status = ResourceStatus.Deleted

    @contextlib.contextmanager
    def handle_exceptions(self) -> Iterator[None]:
        yield  # the decorator never delegates to it

    @property
    def machine_meta_data(self) -> Any:
        return AttributeDict(Cores=2, Memory=4, Disk=8)

    @property
    def drone_heartbeat_interval(self) -> int:
        return self.heartbeat_s

    @property
    def drone_minimum_lifetime(self) -> None:
        return None


class FakeOverlay(BatchSystemAdapter):  # type: ignore[misc]
    """A batch-system adapter with scripted answers; ``fail`` is raised by every call"""

    def __init__(
        self, status: MachineStatus = MachineStatus.Available, fail: Exception | None = None
    ) -> None:
        self.status = status
        self.fail = fail
        self.calls: list[tuple[str, str]] = []

    def _call(self, name: str, drone_uuid: str) -> None:
        self.calls.append((name, drone_uuid))
        if self.fail is not None:
            raise self.fail

    def called(self, name: str) -> int:
        return sum(1 for call, _ in self.calls if call == name)

    async def integrate_machine(self, drone_uuid: str) -> None:
        self._call("integrate_machine", drone_uuid)

    async def disintegrate_machine(self, drone_uuid: str) -> None:
        self._call("disintegrate_machine", drone_uuid)

    async def drain_machine(self, drone_uuid: str) -> None:
        self._call("drain_machine", drone_uuid)
        self.status = MachineStatus.Drained

    async def get_machine_status(self, drone_uuid: str) -> MachineStatus:
        self._call("get_machine_status", drone_uuid)
        return self.status

    async def get_allocation(self, drone_uuid: str) -> float:
        self._call("get_allocation", drone_uuid)
        return 0.25

    async def get_utilisation(self, drone_uuid: str) -> float:
        self._call("get_utilisation", drone_uuid)
        return 0.25

    @property
    def machine_meta_data_translation_mapping(self) -> Any:
        return AttributeDict(Cores=1, Memory=1024, Disk=1024 * 1024)


@dataclass
class Rig:
    """A TARDIS drone on the decorated fake adapters, its recorder, and its fake agent"""

    drone: Any
    site: FakeSite
    overlay: FakeOverlay
    recorder: Transitions
    agent: FakeDrone


def rig(
    bus: RemoteBus,
    drone_uuid: str | None = None,
    *,
    cls: type[Drone] = EventDrone,
    heartbeat_s: int = LONG_HEARTBEAT_S,
    overlay: MachineStatus = MachineStatus.NotAvailable,
    **options: Any,
) -> Rig:
    """A TARDIS drone of ``cls`` (``options`` go to it) on fake adapters the bus decorates"""
    site, batch, recorder = FakeSite(heartbeat_s=heartbeat_s), FakeOverlay(overlay), Transitions()
    drone = cls(
        site_agent=SiteAgent(RemoteSiteAdapter(site, bus)),
        batch_system_agent=BatchSystemAgent(RemoteBatchSystemAdapter(batch, bus)),
        plugins=[TardisStateNotes(bus), recorder],
        drone_uuid=drone_uuid,
        **({"waker": bus.waker} if issubclass(cls, EventDrone) else {}),
        **options,
    )
    return Rig(drone, site, batch, recorder, FakeDrone(SITE, drone.resource_attributes.drone_uuid))


class FakeControl:
    """
    Answers ``may_remove`` from a script; records releases and drains

    :attr:`claimed`: whether the drone's agent claimed its record (``drain_or_release``
    drains it), else it is released
    """

    def __init__(self, *verdicts: Verdict) -> None:
        self.verdicts = list(verdicts)
        self.calls: list[str] = []
        self.lbs: list[bool | None] = []
        self.claimed = True

    def may_remove(
        self, site: str, drone: str, lbs_running: bool | None, now: float | None = None
    ) -> Verdict:
        self.calls.append("may_remove")
        self.lbs.append(lbs_running)
        return self.verdicts.pop(0) if len(self.verdicts) > 1 else self.verdicts[0]

    async def release(self, site: str, drone: str, **kwargs: Any) -> ReleaseResult:
        self.calls.append("release")
        return ReleaseResult(ReleaseOutcome.RELEASED, ev.RecordPhase.RELEASED)

    async def drain(self, site: str, drone: str, *args: Any, **kwargs: Any) -> DrainResult:
        self.calls.append("drain")
        return DrainResult(DrainOutcome.ACCEPTED, ev.RecordPhase.DRAINING)

    async def drain_or_release(
        self, site: str, drone: str, *args: Any, **kwargs: Any
    ) -> DrainResult | ReleaseResult:
        self.calls.append("drain_or_release")
        if self.claimed:
            return DrainResult(DrainOutcome.ACCEPTED, ev.RecordPhase.DRAINING)
        return ReleaseResult(ReleaseOutcome.RELEASED, ev.RecordPhase.RELEASED)


def yes(reason: Removal = Removal.RELEASED_BY_MANAGER) -> Verdict:
    return Verdict(True, reason, "test: yes")


def no(reason: Removal) -> Verdict:
    return Verdict(False, reason, f"test: no ({reason})")


def offline_bus(**config: Any) -> RemoteBus:
    """A bus that never connects (its control is ``None`` until a test sets one)"""
    return RemoteBus(BusConfig(servers=("nats://127.0.0.1:1",), **config), register=False)


def with_control(bus: RemoteBus, control: Any) -> RemoteBus:
    bus.manager.control = control
    bus.manager.ready.set()
    return bus


def attributes(drone: str = DRONE, **extra: Any) -> AttributeDict:
    return AttributeDict(
        site_name=SITE_NAME,
        machine_type="m1",
        obs_machine_meta_data_translation_mapping=AttributeDict(Cores=1, Memory=1024, Disk=1),
        remote_resource_uuid="1.0",
        drone_uuid=drone,
        **extra,
    )


def announce(
    registry: Registry,
    drone: str,
    state: ev.DroneState,
    *,
    payloads: int = 0,
    seq: int = 1,
    received: float | None = None,
    site: str = SITE,
    end: ev.DroneEnd | None = None,
) -> None:
    """
    Put a heartbeat of ``drone`` in ``state`` into ``registry``, as if it came off the stream;
    ``end``: when its batch job ends
    """
    now = ev.utcnow()
    snapshot = ev.Snapshot(
        state=state,
        since=now,
        gate_open=state in (ev.DroneState.IDLE, ev.DroneState.BUSY),
        slots=2,
        payloads=[ev.Payload(job_id=f"{i}.0", started_at=now) for i in range(payloads)],
        started_at=now,
        end=end,
    )
    event = ev.Heartbeat(
        site=site,
        drone=drone,
        incarnation="inc1",
        seq=seq,
        at=now,
        id=dedupe_id(drone, "inc1", seq),
        snapshot=snapshot,
        interval_s=1.0,
    )
    subject = registry.namespace.event(site, drone, "heartbeat")
    registry.apply(event, subject, time.time() if received is None else received)
