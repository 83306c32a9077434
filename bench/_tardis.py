"""
The TARDIS side the lag and flood benchmarks run: a site of in-process agents, and the lags

TARDIS's own state machine runs through the decorated adapters
(:class:`~broker.tardis.site.RemoteSiteAdapter` around :class:`BenchSite`, whose
``deploy_resource`` starts a real in-process :class:`~remote_agent.agent.Agent` after a
random queue delay, :class:`~broker.tardis.batch.RemoteBatchSystemAdapter` around
:class:`BlindOverlay`, which knows nothing). The lags are read afterwards from the stream:
each agent event's ``at`` beside the ``at`` of TARDIS's state notes
(:class:`~broker.tardis.plugin.TardisStateNotes`) for the same drone.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DeliverPolicy
from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.utilities.attributedict import AttributeDict

from broker.jetstream.reads import read_all
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace
from remote_agent.settings import Settings

#: the lags reported: (row, from the agent's event kind, to TARDIS's first state of these)
ROWS: Sequence[tuple[str, str, tuple[str, ...]]] = (
    ("gate open -> Integrating", "gate_opened", ("IntegratingState", "AvailableState")),
    ("gate open -> Available", "gate_opened", ("AvailableState",)),
    ("drained -> Down", "drained", ("DownState",)),
    ("agent_exiting -> Down", "agent_exiting", ("DownState",)),
)


class BenchSite(SiteAdapter):  # type: ignore[misc]
    """
    A site whose jobs are in-process agents, started after a queue delay of 0.2-1 s

    :param settings: the agent settings of a drone, by its uuid
    :param external: drones whose job runs elsewhere (a benchmark's own publisher):
        their deploy starts nothing and their job runs until the end
    """

    def __init__(
        self,
        settings: Callable[[str], Settings],
        heartbeat_s: int,
        rng: random.Random,
        site_name: str,
        external: Collection[str] = (),
    ) -> None:
        self._settings = settings
        self._heartbeat_s = heartbeat_s
        self._rng = rng
        self._machine_type = "m1"
        self._site_name = site_name
        self._external = frozenset(external)
        self.agents: dict[str, asyncio.Task[int]] = {}
        self.started: set[str] = set()

    async def deploy_resource(self, resource_attributes: Any) -> Any:
        drone = str(resource_attributes["drone_uuid"])
        if drone in self._external:
            self.started.add(drone)
        else:
            self.agents[drone] = asyncio.create_task(self._job(drone, self._rng.uniform(0.2, 1.0)))
        return AttributeDict(remote_resource_uuid=drone, resource_status=ResourceStatus.Booting)

    async def _job(self, drone: str, queued_s: float) -> int:
        await asyncio.sleep(queued_s)
        self.started.add(drone)
        return await Agent(self._settings(drone)).run()

    async def resource_status(self, resource_attributes: Any) -> Any:
        drone = str(resource_attributes["drone_uuid"])
        task = self.agents.get(drone)
        if drone in self._external:
            status = ResourceStatus.Running
        elif task is None or task.done():
            status = ResourceStatus.Deleted
        else:
            status = ResourceStatus.Running if drone in self.started else ResourceStatus.Booting
        return AttributeDict(resource_status=status)

    async def stop_resource(self, resource_attributes: Any) -> None:
        return None  # the agent ends its own job once drained

    async def terminate_resource(self, resource_attributes: Any) -> None:
        task = self.agents.get(str(resource_attributes["drone_uuid"]))
        if task is not None:
            task.cancel()

    @contextlib.contextmanager
    def handle_exceptions(self) -> Iterator[None]:
        yield

    @property
    def machine_meta_data(self) -> Any:
        return AttributeDict(Cores=1, Memory=1, Disk=1)

    @property
    def drone_heartbeat_interval(self) -> int:
        return self._heartbeat_s

    @property
    def drone_minimum_lifetime(self) -> None:
        return None


class BlindOverlay(BatchSystemAdapter):  # type: ignore[misc]
    """An overlay batch system that knows nothing: every answer comes from the agents"""

    async def integrate_machine(self, drone_uuid: str) -> None:
        return None

    async def disintegrate_machine(self, drone_uuid: str) -> None:
        return None

    async def drain_machine(self, drone_uuid: str) -> None:
        return None

    async def get_machine_status(self, drone_uuid: str) -> MachineStatus:
        return MachineStatus.NotAvailable

    async def get_allocation(self, drone_uuid: str) -> float:
        return 0.0

    async def get_utilisation(self, drone_uuid: str) -> float:
        return 0.0

    @property
    def machine_meta_data_translation_mapping(self) -> Any:
        return AttributeDict(Cores=1, Memory=1, Disk=1)


class States:
    """A TARDIS plugin: each drone's latest state, by uuid"""

    def __init__(self) -> None:
        self.latest: dict[str, str] = {}

    async def notify(self, state: Any, resource_attributes: Any) -> None:
        self.latest[str(resource_attributes["drone_uuid"])] = str(state)


async def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; :raises TimeoutError: after ``timeout_s``"""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def read_stream(
    nc: Client, namespace: Namespace, site: str, drones: Collection[str]
) -> list[ev.Event | ev.TardisState]:
    """Every agent event and TARDIS note of ``drones`` (of ``site``), in stream order"""
    found: list[ev.Event | ev.TardisState] = []
    prefix = f"{namespace.prefix}.{site}."

    def collect(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        if subject.removeprefix(prefix).split(".", 1)[0] not in drones:
            return
        with contextlib.suppress(Exception):
            found.append(ev.decode_note(data) if ".mgr." in subject else ev.decode_event(data))

    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, filter_subjects=[f"{prefix}>"])
    await read_all(nc, nc.jetstream(), namespace.event_stream, config, collect, headers=True)
    return found


def lags(
    messages: Sequence[ev.Event | ev.TardisState], drones: Collection[str]
) -> dict[str, list[tuple[dt.datetime, float]]]:
    """
    The lags of :data:`ROWS` over ``drones``, from the stream's messages

    :returns: by row, ``(the agent event's at, the lag in seconds)`` for each drone
    """
    out: dict[str, list[tuple[dt.datetime, float]]] = {}
    for row, start, targets in ROWS:
        found: list[tuple[dt.datetime, float]] = []
        begun: dict[str, dt.datetime] = {}
        taken: set[str] = set()  # each drone's first matching event only
        for message in messages:
            drone = message.drone
            if drone not in drones:
                continue
            if isinstance(message, ev.TardisState):
                if drone in begun and message.state in targets:
                    at = begun.pop(drone)
                    found.append((at, (message.at - at).total_seconds()))
            elif drone not in taken and start == ev.kind_of(type(message)):
                begun[drone] = message.at
                taken.add(drone)
        out[row] = found
    return out
