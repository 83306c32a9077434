"""
Lag benchmark: an agent's event to TARDIS's matching state change, event-driven and heartbeat-only

Run from the repository root::

    .venv/bin/python bench/lag.py                  # 10 drones per mode, 10 s heartbeat, < 3 min
    .venv/bin/python bench/lag.py --heartbeat 4 --drones 5   # < 1 min
    .venv/bin/python bench/lag.py --noisy --heartbeat 4      # quiet, then a drone flooding, < 2 min

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

With ``--noisy`` it runs twice, first as above (the baseline) and then with one more
event-driven drone whose job is no agent but a flooder in a process of its own: it
publishes valid events of that drone without waiting for acks, as fast as its connection
takes them (or ``--flood-rate`` a second), each flipping the drone between idle and busy (a
payload starts, it ends), from before the other drones start until they are all Down. It
reports the other drones' lags of both runs and their ratio, the CPU this process and the
server used during the flood, the noisy drone's TARDIS state runs per second, whether the
registry found it noisy, and how soon its newest event was applied after the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import random
import signal
import subprocess
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
from remote_agent.protocol.connect import connect
from remote_agent.protocol.names import Namespace, dedupe_id

SITE_NAME = "Bench"
SITE = "bench"
#: the drone whose job floods the bus (``--noisy``)
NOISY = f"{SITE}-ffffffffff"
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
        #: the flooder of :data:`NOISY`, once its job started, and its events a second
        self.flooder: asyncio.subprocess.Process | None = None
        self.flood_rate = 0.0
        #: CPU seconds of this process and of the server when the flood began
        self.flood_cpu = (0.0, 0.0)

    async def deploy_resource(self, resource_attributes: Any) -> Any:
        drone = str(resource_attributes["drone_uuid"])
        queued_s = 0.0 if drone == NOISY else self._rng.uniform(0.2, 1.0)
        self.agents[drone] = asyncio.create_task(self._job(drone, queued_s))
        return AttributeDict(remote_resource_uuid=drone, resource_status=ResourceStatus.Booting)

    async def _job(self, drone: str, queued_s: float) -> int:
        await asyncio.sleep(queued_s)
        self.started.add(drone)
        if drone == NOISY:
            self.flood_cpu = (_common.cpu_seconds(), _common.cpu_seconds(self._bus.server.pid))
            self.flooder = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--flooder",
                self._bus.url,
                self._bus.namespace.prefix,
                str(self.flood_rate),
                stdout=subprocess.PIPE,
            )
            return await self.flooder.wait()
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


async def run(
    n: int, heartbeat_s: int, seed: int, flood_rate: float | None = None
) -> dict[str, Any]:
    """One run; with ``flood_rate`` (events a second, 0: as fast as it can) a noisy drone too"""
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
        site.flood_rate = flood_rate or 0.0
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
        loud: EventDrone | None = None
        loud_task: asyncio.Task[None] | None = None
        flood: dict[str, Any] | None = None
        if flood_rate is not None:
            loud = EventDrone(
                site_agent=site_agent,
                batch_system_agent=batch_agent,
                plugins=list(plugins),
                drone_uuid=NOISY,
                waker=remote.waker,
            )
            loud_task = asyncio.create_task(loud.run())
            await wait_for(lambda: remote.registry.view(SITE, NOISY) is not None, 30, "the flood")
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
            flood = await stop_flood(bus, remote, site, loud) if loud is not None else None
            await wait_for(lambda: not remote.pending_notes, 30, "the notes published")
            await asyncio.gather(*site.agents.values(), return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            if loud_task is not None:
                loud_task.cancel()
            for task in site.agents.values():
                task.cancel()
            if site.flooder is not None and site.flooder.returncode is None:
                site.flooder.kill()
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
    if flood is not None:
        report["noisy"] = flood
    return report


async def stop_flood(
    bus: Bus, remote: RemoteBus, site: BenchSite, loud: EventDrone
) -> dict[str, Any]:
    """
    End the flood; what it was, and how long its newest event took to be applied after it

    :returns: events sent, seconds, the registry's applied and coalesced events (all
        drones), the noisy drone's TARDIS state runs, their rate and how many waited for
        its budget, and the seconds from the flood's end until the registry's view of the
        drone was the flooder's last event (polled every 50 ms)
    """
    flooder = site.flooder
    assert flooder is not None and flooder.stdout is not None
    flooder.send_signal(signal.SIGTERM)
    out = await asyncio.wait_for(flooder.stdout.read(), 30)
    await flooder.wait()
    ended = time.monotonic()
    own_cpu, server_cpu = _common.cpu_seconds(), _common.cpu_seconds(bus.server.pid)
    sent, flood_s = out.decode().split()
    stream, ns = bus.namespace.event_stream, bus.namespace
    newest = max(  # the flooder's last event, on one of its two subjects
        [
            (await bus.js.get_last_msg(stream, ns.event(SITE, NOISY, kind))).seq
            for kind in ("payload_started", "payload_finished")
        ]
    )

    def applied() -> bool:
        view = remote.registry.view(SITE, NOISY)
        return view is not None and view.stream_seq == newest

    await wait_for(applied, 60, "the noisy drone's newest event applied")
    after_s = time.monotonic() - ended
    metrics = remote.registry.metrics()
    return {
        "sent": int(sent),
        "seconds": float(flood_s),
        "rate": int(sent) / float(flood_s),
        "cpu_per_s": (own_cpu - site.flood_cpu[0]) / float(flood_s),
        "server_cpu_per_s": (server_cpu - site.flood_cpu[1]) / float(flood_s),
        "registry_applied": metrics.applied,
        "registry_coalesced": metrics.coalesced,
        "noisy": [drone for _, drone in remote.registry.noisy(time.time())],
        "state_runs": loud.state_runs,
        "state_runs_per_s": loud.state_runs / float(flood_s),
        "state_runs_delayed": loud.delayed,
        "newest_applied_after_s": after_s,
    }


async def flooder(url: str, prefix: str, rate: float) -> None:
    """
    Publish events of :data:`NOISY` until SIGTERM, ``rate`` a second (0: as fast as the
    connection takes them)

    Each flips the drone between idle and busy; prints the events sent and the seconds.
    """
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    ns = Namespace(prefix)
    nc = await connect(url, pending_size=32 * 1024 * 1024)
    t0 = ev.utcnow()
    payload = ev.Payload(job_id="1.0", slot="slot1_1", started_at=t0)
    seq, started = 0, time.monotonic()
    while not stop.is_set():
        for _ in range(100):
            seq += 1
            busy = seq % 2 == 1
            head: dict[str, Any] = {
                "site": SITE,
                "drone": NOISY,
                "incarnation": "flood",
                "seq": seq,
                "at": ev.utcnow(),
                "id": dedupe_id(NOISY, "flood", seq),
                "snapshot": ev.Snapshot(
                    state=ev.DroneState.BUSY if busy else ev.DroneState.IDLE,
                    since=t0,
                    gate_open=True,
                    slots=1,
                    payloads=[payload] if busy else [],
                    started_at=t0,
                ),
            }
            event: ev.Event = (
                ev.PayloadStarted(**head, job_id="1.0")
                if busy
                else ev.PayloadFinished(**head, job_id="1.0", how=ev.PayloadEnd.EXIT)
            )
            subject = ns.event(SITE, NOISY, ev.kind_of(type(event)))
            await nc.publish(subject, ev.encode(event), headers={"Nats-Msg-Id": event.id})
        with contextlib.suppress(Exception):
            await nc.flush(timeout=5)
        ahead_s = seq / rate - (time.monotonic() - started) if rate else 0.0
        await asyncio.sleep(max(0.0, ahead_s))  # and let the signal handler run
    seconds = time.monotonic() - started
    await nc.flush(timeout=5)
    await nc.close()
    print(seq, seconds)


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


def print_noisy(quiet: dict[str, Any], noisy: dict[str, Any]) -> None:
    flood = noisy["noisy"]
    print(
        f"the noisy drone: {flood['sent']:,} events in {flood['seconds']:.1f} s "
        f"({flood['rate']:,.0f}/s), {flood['registry_coalesced']:,} coalesced; meanwhile CPU "
        f"{flood['cpu_per_s']:.2f} s/s here (manager, agents, TARDIS), "
        f"{flood['server_cpu_per_s']:.2f} s/s the server; its TARDIS "
        f"drone: {flood['state_runs']} state runs ({flood['state_runs_per_s']:.1f}/s, "
        f"{flood['state_runs_delayed']} waited for the budget); noisy: "
        f"{', '.join(flood['noisy']) or 'none'}; its newest event applied within "
        f"{flood['newest_applied_after_s'] * 1e3:.0f} ms of the flood's end"
    )
    rows = []
    for row, _, _ in ROWS:
        q, n = quiet["modes"]["event-driven"][row], noisy["modes"]["event-driven"][row]
        ratio = n["p99_ms"] / q["p99_ms"] if q["p99_ms"] > 0 else float("nan")
        rows.append([row, q["count"], q["p50_ms"], q["p99_ms"], n["p50_ms"], n["p99_ms"], ratio])
    print(
        _common.table(
            [
                "event-driven lag (ms)",
                "n",
                "quiet p50",
                "quiet p99",
                "noisy p50",
                "noisy p99",
                "p99 noisy / quiet",
            ],
            rows,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--drones", type=int, default=10, help="drones per mode [10]")
    parser.add_argument("--heartbeat", type=int, default=10, help="drone_heartbeat_interval [10]")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--noisy", action="store_true", help="run again with a drone flooding the bus"
    )
    parser.add_argument(
        "--flood-rate",
        type=float,
        default=0.0,
        help="the noisy drone's events a second [0: as fast as it can]",
    )
    parser.add_argument(
        "--flooder", nargs=3, metavar=("URL", "PREFIX", "RATE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.flooder:
        url, prefix, rate = args.flooder
        asyncio.run(flooder(url, prefix, float(rate)))
        return 0
    budget = 30 * args.heartbeat + 180
    report = _common.run_bounded(run(args.drones, args.heartbeat, args.seed), budget)
    print_report(report)
    if args.noisy:
        flooded = run(args.drones, args.heartbeat, args.seed, args.flood_rate)
        noisy = _common.run_bounded(flooded, budget)
        print_report(noisy)
        print_noisy(report, noisy)
        report = {"quiet": report, "noisy": noisy}
    print(f"wrote {_common.write_result('lag', report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
