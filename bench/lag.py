"""
Lag benchmark: an agent's event to TARDIS's matching state change, event-driven and heartbeat-only

Run from the repository root::

    .venv/bin/python bench/lag.py                  # 10 drones per mode, 10 s heartbeat, < 3 min
    .venv/bin/python bench/lag.py --heartbeat 4 --drones 5   # < 1 min

It starts its own nats-server (the embedded one, in a temporary directory), a
:class:`~broker.tardis.bus.RemoteBus` (the manager inside COBalD) and, in the same
run, ``--drones`` TARDIS drones of each mode: :class:`~broker.tardis.drone.EventDrone`
(the pool's drones with a bus) and TARDIS's stock ``Drone`` (heartbeat only). Both
run TARDIS's own state machine through the decorated adapters
(:class:`~broker.tardis.site.RemoteSiteAdapter` around a bench site whose
``deploy_resource`` starts a real in-process :class:`~remote_agent.agent.Agent` after a
random queue delay, :class:`~broker.tardis.batch.RemoteBatchSystemAdapter` around an
overlay that knows nothing), with the same ``drone_heartbeat_interval``.

Once every drone is Available, each agent is drained (``Control.drain``, at a random
moment within one heartbeat); it has no payload, so it drains, ends and exits. The lags are
read afterwards from the stream, agent events beside TARDIS's state notes (the notes the
manager publishes, :class:`~broker.tardis.notes.TardisStateNotes`):

* agent up (its first event; TARDIS's answers say Running from then on) -> ``IntegratingState``
  and -> ``AvailableState``;
* ``drained`` -> ``DownState`` (includes the agent's own ending) and ``agent_exiting`` ->
  ``DownState``.

It prints count/p50/p99/max per mode with the ratio heartbeat-only / event-driven and
writes JSON to ``bench/results/lag-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import random
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import _common
from _common import Bus, percentiles
from nats.js.api import ConsumerConfig, DeliverPolicy
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.resources.drone import Drone
from tardis.utilities.attributedict import AttributeDict

from broker.jetstream.reads import read_all
from broker.tardis.drone import EventDrone
from broker.tardis_adapter import (
    BusConfig,
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace

SITE_NAME = "Bench"
SITE = "bench"
GOAL_P99_MS = 100.0
GOAL_RATIO = 100.0

#: the lags reported: (row, from the agent's event kind, to TARDIS's first state of these)
ROWS: Sequence[tuple[str, str, tuple[str, ...]]] = (
    ("agent up -> Integrating", "up", ("IntegratingState", "AvailableState")),
    ("agent up -> Available", "up", ("AvailableState",)),
    ("drained -> Down", "drained", ("DownState",)),
    ("agent_exiting -> Down", "agent_exiting", ("DownState",)),
)


class BenchSite(SiteAdapter):  # type: ignore[misc]
    """A site whose jobs are in-process agents, started after a queue delay"""

    def __init__(self, bus: Bus, heartbeat_s: int, rng: random.Random) -> None:
        self._bus = bus
        self._heartbeat_s = heartbeat_s
        self._rng = rng
        self._machine_type = "m1"
        self._site_name = SITE_NAME
        self.agents: dict[str, asyncio.Task[int]] = {}
        self.started: set[str] = set()

    async def deploy_resource(self, resource_attributes: Any) -> Any:
        drone = str(resource_attributes["drone_uuid"])
        self.agents[drone] = asyncio.create_task(self._job(drone, self._rng.uniform(0.2, 1.0)))
        return AttributeDict(remote_resource_uuid=drone, resource_status=ResourceStatus.Booting)

    async def _job(self, drone: str, queued_s: float) -> int:
        await asyncio.sleep(queued_s)
        self.started.add(drone)
        return await Agent(_common.agent_settings(self._bus, SITE, drone, 30.0)).run()

    async def resource_status(self, resource_attributes: Any) -> Any:
        drone = str(resource_attributes["drone_uuid"])
        task = self.agents.get(drone)
        if task is None or task.done():
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


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def drain_all(remote: RemoteBus, drones: Sequence[str], spread_s: float, seed: int) -> None:
    rng = random.Random(seed)
    control = remote.control
    assert control is not None

    async def drain(drone: str) -> None:
        await asyncio.sleep(rng.uniform(0, spread_s))
        await control.drain(SITE, drone, remote.drain_deadline(), "bench")

    await asyncio.gather(*(drain(drone) for drone in drones))


async def read_stream(bus: Bus) -> list[ev.Event | ev.TardisState]:
    """Every agent event and TARDIS note of the run, in stream order"""
    found: list[ev.Event | ev.TardisState] = []

    def collect(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        with contextlib.suppress(Exception):
            found.append(ev.decode_note(data) if ".mgr." in subject else ev.decode_event(data))

    prefix = f"{bus.namespace.prefix}.{SITE}."
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, filter_subjects=[f"{prefix}>"])
    await read_all(bus.nc, bus.js, bus.namespace.event_stream, config, collect, headers=True)
    return found


def lags(messages: Sequence[ev.Event | ev.TardisState], drones: set[str]) -> dict[str, list[float]]:
    """The lags of :data:`ROWS` (seconds) over ``drones``, from the stream's messages"""
    out: dict[str, list[float]] = {}
    for row, start, targets in ROWS:
        found: list[float] = []
        begun: dict[str, dt.datetime] = {}
        taken: set[str] = set()  # each drone's first matching event only
        for message in messages:
            drone = message.drone
            if drone not in drones:
                continue
            if isinstance(message, ev.TardisState):
                if drone in begun and message.state in targets:
                    found.append((message.at - begun.pop(drone)).total_seconds())
            elif drone not in taken and start in ("up", ev.kind_of(type(message))):
                begun[drone] = message.at
                taken.add(drone)
        out[row] = found
    return out


async def run(n: int, heartbeat_s: int, seed: int) -> dict[str, Any]:
    namespace = Namespace("benchlag")
    rng = random.Random(seed)
    async with _common.bus(namespace) as bus:
        remote = RemoteBus(
            BusConfig.from_mapping(
                {"servers": bus.url, "prefix": namespace.prefix, "lost_after_s": 600}
            ),
            register=False,
        )
        bus_task = asyncio.create_task(remote.run())
        assert await remote.wait_ready(30), "the bus did not connect"
        site = BenchSite(bus, heartbeat_s, rng)
        site_agent = SiteAgent(RemoteSiteAdapter(site, remote))
        batch_agent = BatchSystemAgent(RemoteBatchSystemAdapter(BlindOverlay(), remote))
        states = States()
        plugins = [TardisStateNotes(remote), states]
        modes: dict[str, list[Any]] = {"event-driven": [], "heartbeat only": []}
        for i in range(n):
            for mode, cls in (("event-driven", EventDrone), ("heartbeat only", Drone)):
                extra = {"waker": remote.waker} if cls is EventDrone else {}
                drone_uuid = f"{SITE}-{'e' if cls is EventDrone else 'h'}{i:09x}"
                modes[mode].append(
                    cls(
                        site_agent=site_agent,
                        batch_system_agent=batch_agent,
                        plugins=list(plugins),
                        drone_uuid=drone_uuid,
                        **extra,
                    )
                )
        every = [d for drones in modes.values() for d in drones]
        uuids = [d.resource_attributes.drone_uuid for d in every]
        started = time.monotonic()
        tasks = [asyncio.create_task(d.run()) for d in every]
        try:
            await wait_for(
                lambda: all(states.latest.get(u) == "AvailableState" for u in uuids),
                12 * heartbeat_s + 30,
                "every drone Available",
            )
            await drain_all(remote, uuids, heartbeat_s, seed)
            await asyncio.wait_for(asyncio.gather(*tasks), 12 * heartbeat_s + 60)
            await wait_for(lambda: not remote.pending_notes, 30, "the notes published")
            await asyncio.gather(*site.agents.values(), return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            for task in site.agents.values():
                task.cancel()
            remote.stop()
            await asyncio.wait_for(bus_task, 30)
        seconds = time.monotonic() - started
        messages = await read_stream(bus)
    report: dict[str, Any] = {
        "drones_per_mode": n,
        "heartbeat_s": heartbeat_s,
        "seed": seed,
        "seconds": seconds,
        "modes": {},
    }
    for mode, drones in modes.items():
        names = {d.resource_attributes.drone_uuid for d in drones}
        report["modes"][mode] = {row: percentiles(v) for row, v in lags(messages, names).items()}
    report["state_runs"] = {
        mode: sum(getattr(d, "state_runs", 0) for d in drones) for mode, drones in modes.items()
    }
    return report


def print_report(report: dict[str, Any]) -> None:
    events, stock = report["modes"]["event-driven"], report["modes"]["heartbeat only"]
    rows = []
    for row, _, _ in ROWS:
        e, h = events[row], stock[row]
        ratio = h["p99_ms"] / e["p99_ms"] if e["p99_ms"] > 0 else float("nan")
        rows.append(
            [row, e["count"], e["p50_ms"], e["p99_ms"], h["p50_ms"], h["p99_ms"], f"{ratio:,.0f}x"]
        )
    print(
        f"{report['drones_per_mode']} drones per mode, drone_heartbeat_interval "
        f"{report['heartbeat_s']} s, seed {report['seed']}, {report['seconds']:.0f} s"
    )
    print(
        _common.table(
            [
                "lag (ms)",
                "n",
                "events p50",
                "events p99",
                "heartbeat p50",
                "heartbeat p99",
                "p99 ratio",
            ],
            rows,
        )
    )
    print(
        f"goals: event-driven p99 < {GOAL_P99_MS:.0f} ms, heartbeat-only p99 / event-driven p99"
        f" >= {GOAL_RATIO:.0f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--drones", type=int, default=10, help="drones per mode [10]")
    parser.add_argument("--heartbeat", type=int, default=10, help="drone_heartbeat_interval [10]")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    budget = 30 * args.heartbeat + 180
    report = _common.run_bounded(run(args.drones, args.heartbeat, args.seed), budget)
    print_report(report)
    print(f"wrote {_common.write_result('lag', report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
