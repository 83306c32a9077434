"""
Fleet benchmark: one COBalD process with thousands of TARDIS drones, event-driven beside stock

Run from the repository root::

    .venv/bin/python bench/fleet.py                       # 5,000 drones per mode, < 10 min
    .venv/bin/python bench/fleet.py --drones 500 2000     # each size in turn
    .venv/bin/python bench/fleet.py --quick               # 300 drones, shorter windows, ~2 min
    .venv/bin/python bench/fleet.py --quick --profile     # cProfile the measured window

For each size, two processes in turn, each one COBalD process as a site runs it: the pool that
``!RemoteTardisPoolFactory`` builds (:func:`broker.tardis.factory.create_composite_pool`, here
from a configuration mapping), with ``--drones`` real TARDIS drones in it, their state
machines running in that process (COBalD's controller does not run: the demand is fixed).

* **stock**: no ``bus`` section, so TARDIS's own ``Drone`` on the fake site and overlay of
  ``_fleet_site.py`` (in-process, each answer a lookup in the fleet's plan), one state run per
  ``drone_heartbeat_interval`` (TARDIS's default, 60 s).
* **event-driven**: the same configuration with a ``bus`` section: ``EventDrone`` on the same
  fake adapters wrapped by the decorators, and the manager (``RemoteBus``) consuming the agents'
  events from a real nats-server this process starts. The agents are simulated by a second
  process (``_fleet_agents.py``) that publishes the fleet's plan when due: 30 s heartbeats,
  8 slots a drone running payloads of 30 min on average, 2 % of the drones draining.

Measured in a window after the ramp and the first fill of the slots (``--measure`` s): the
process's CPU and resident memory per drone, state runs a second (every ``Drone.set_state``),
the fake adapters' calls a second, and the lag from each fact an agent publishes (a gate
opening, a payload start or end, a drain) to the first state run whose adapter call reads it
(stock: from the plan at that moment; event-driven: from the registry).

Then, event-driven only, a **reconnect storm**: the nats-server restarts; the manager and every
agent connection reconnect, and each agent sends its newest event again and a heartbeat with its
whole snapshot. For ``--after`` seconds: wakes beyond the facts planned per drone, state runs
beyond the steady rate, the time until the lag's p99 (per second of events) stays under
100 ms, and whether any drone is lost, ended, released or drained, or has left TARDIS's
AvailableState, that the plan did not end.

Prints a table and writes JSON to ``bench/results/fleet-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _common
from _common import percentiles
from _fleet_agents import FACTS, SITE, Params, Plan
from _fleet_site import CALLS, Fleet
from cobald.composite.factory import FactoryPool
from tardis.configuration.configuration import Configuration
from tardis.resources.drone import Drone

from broker.jetstream.fastpath import Direct
from broker.tardis.factory import create_composite_pool
from remote_agent.protocol.events import RecordPhase
from remote_agent.protocol.names import Namespace

HEARTBEAT_S = 60  # TARDIS's default drone_heartbeat_interval
GOAL_P99_MS = 100.0
GOAL_RECOVERY_S = 10.0
HERE = Path(__file__).resolve().parent
#: every state run of every drone in this process (``Drone.set_state`` ends each)
RUNS = [0]


def _count_runs() -> None:
    original = Drone.set_state

    async def counted(self: Drone, state: Any) -> None:
        RUNS[0] += 1
        await original(self, state)

    Drone.set_state = counted  # type: ignore[method-assign]


def tardis_config(heartbeat_s: int) -> dict[str, Any]:
    return {
        "BatchSystem": {"adapter": "_fleet_site:FleetOverlay"},
        "Sites": [
            {
                "name": SITE.capitalize(),
                "adapter": "_fleet_site:FleetSite",
                "quota": -1,
                "drone_heartbeat_interval": heartbeat_s,
            }
        ],
        SITE.capitalize(): {
            "MachineTypes": ["m8"],
            "MachineTypeConfiguration": {"m8": {}},
            "MachineMetaData": {"m8": {"Cores": 8, "Memory": 16, "Disk": 100}},
        },
    }


def pools(node: Any) -> Iterator[FactoryPool]:
    """The factory pools of a composite pool"""
    if isinstance(node, FactoryPool):
        yield node
    for child in getattr(node, "children", ()):
        yield from pools(child)
    if (target := getattr(node, "target", None)) is not None:
        yield from pools(target)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Probe:
    """
    The lag from each planned fact to the first state run whose adapter call reads it

    :param covered: the newest planned ``seq`` a call of the drone's adapters reads now
    """

    def __init__(self, plan: Plan, t0: float, covered: Any) -> None:
        self.plan, self.t0, self.covered = plan, t0, covered
        self._next: dict[str, int] = dict.fromkeys(plan.lives, 0)
        #: (planned at, lag s, kind) of every fact read
        self.lags: list[tuple[float, float, str]] = []

    def read(self, drone: str) -> None:
        life = self.plan.lives.get(drone)
        if life is None:
            return
        seq = self.covered(drone)
        k, events, now = self._next[drone], life.events, time.time() - self.t0
        while k < len(events) and events[k][1] <= seq:
            at, _, kind, _ = events[k]
            if kind in FACTS:
                self.lags.append((at, now - at, kind))
            k += 1
        self._next[drone] = k

    def wrap(self, site_adapter: Any, batch_adapter: Any) -> None:
        status, machine = site_adapter.resource_status, batch_adapter.get_machine_status

        async def resource_status(resource_attributes: Any) -> Any:
            answer = await status(resource_attributes)
            self.read(resource_attributes.drone_uuid)
            return answer

        async def get_machine_status(drone_uuid: str) -> Any:
            answer = await machine(drone_uuid=drone_uuid)
            self.read(drone_uuid)
            return answer

        site_adapter.resource_status = resource_status
        batch_adapter.get_machine_status = get_machine_status

    def window(self, lo: float, hi: float, kinds: Sequence[str] = FACTS) -> dict[str, float]:
        return percentiles([lag for at, lag, kind in self.lags if lo <= at < hi and kind in kinds])

    def windows(self, params: Params) -> dict[str, dict[str, float]]:
        """The lags of the ramp and of the measured window, all and by kind"""
        lo, hi = params.measure_from_s, params.measure_to_s
        return {
            "ramp": self.window(0, lo),
            "steady": self.window(lo, hi),
            "steady_payload": self.window(lo, hi, ("payload_started", "payload_finished")),
            "steady_drain": self.window(lo, hi, ("draining", "drained", "agent_exiting")),
        }


@contextlib.contextmanager
def profiled(enabled: bool, name: str) -> Iterator[None]:
    if not enabled:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
        _common.RESULTS.mkdir(parents=True, exist_ok=True)
        path = _common.RESULTS / f"fleet-{name}-{time.strftime('%Y%m%dT%H%M%S')}.txt"
        path.write_text(out.getvalue())
        print(f"profile: {path}", file=sys.stderr)


async def until(t0: float, at: float) -> None:
    await asyncio.sleep(max(0.0, t0 + at - time.time()))


class Monitor:
    """Every 50 ms: how late the event loop wakes (its stalls), and the notes not yet published"""

    def __init__(self, remote: Any) -> None:
        self.remote = remote
        self.stalls: list[tuple[float, float]] = []  # (monotonic, seconds late)
        self.notes_max = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.05
            await asyncio.sleep(0.05)
            self.stalls.append((time.monotonic(), loop.time() - due))
            if self.remote is not None:
                self.notes_max = max(self.notes_max, len(self.remote._notes))

    def window(self, lo: float, hi: float) -> dict[str, float]:
        return percentiles([late for at, late in self.stalls if lo <= at < hi])


class Liveness:
    """How long the manager's liveness ticks take (``Registry.mark_ended`` and ``mark_lost``)"""

    def __init__(self, registry: Any) -> None:
        self.ticks: list[float] = []
        ended, lost = registry.mark_ended, registry.mark_lost

        def mark_ended(now: float) -> Any:
            self._started = time.perf_counter()
            return ended(now)

        def mark_lost(now: float) -> Any:
            newly = lost(now)
            self.ticks.append(time.perf_counter() - self._started)
            return newly

        self._started = 0.0
        registry.mark_ended, registry.mark_lost = mark_ended, mark_lost


def ack_writes() -> int:
    """Writes of acks on every connection of this process (the manager's)"""
    return sum(getattr(direct, "writes", 0) for direct in list(Direct._installed.values()))


class Sampler:
    """What a window of the run measures: CPU, state runs, adapter calls, wakes"""

    def __init__(self, drones: Sequence[Any], liveness: Liveness | None = None) -> None:
        self.drones = drones
        self.liveness = liveness

    def take(self) -> dict[str, Any]:
        return {
            "time": time.monotonic(),
            "cpu": _common.cpu_seconds(),
            "runs": RUNS[0],
            "calls": sum(CALLS.values()),
            "batch_calls": sum(
                n for call, n in CALLS.items() if call not in ("resource_status", "deploy_resource")
            ),
            "woken": [getattr(d, "woken", 0) for d in self.drones],
            "rss": rss_bytes(),
            "ack_writes": ack_writes(),
            "ticks": len(self.liveness.ticks) if self.liveness is not None else 0,
        }


def rates(a: dict[str, Any], b: dict[str, Any], n: int) -> dict[str, float]:
    seconds = b["time"] - a["time"]
    cpu = b["cpu"] - a["cpu"]
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "cpu_share": cpu / seconds,
        "cpu_us_per_drone_s": 1e6 * cpu / seconds / n,
        "state_runs_per_s": (b["runs"] - a["runs"]) / seconds,
        "adapter_calls_per_s": (b["calls"] - a["calls"]) / seconds,
        "batch_calls_per_s": (b["batch_calls"] - a["batch_calls"]) / seconds,
        "ack_writes_per_s": (b["ack_writes"] - a["ack_writes"]) / seconds,
    }


def covered_by(remote: Any, plan: Plan, t0: float) -> Callable[[str], int]:
    """What a state run reads: the registry's newest event, or the plan at this moment"""
    if remote is not None:
        registry = remote.registry

        def from_registry(drone: str) -> int:
            view = registry.view(SITE, drone)
            return view.seq if view is not None and view.seq is not None else -1

        return from_registry

    def from_plan(drone: str) -> int:
        life = plan.lives[drone]
        k = life.newest(time.time() - t0)
        return life.events[k][1] if k >= 0 else -1

    return from_plan


async def child(
    mode: str, params: Params, heartbeat_s: int, connections: int, profile: bool
) -> dict[str, Any]:
    """One COBalD process: ``mode`` ``stock`` or ``event``"""
    _count_runs()
    plan = Plan(params)
    n = params.drones
    async with contextlib.AsyncExitStack() as stack:
        bus = remote = None
        if mode == "event":
            namespace = Namespace("fleet")
            bus = await stack.enter_async_context(_common.bus(namespace))
            bus_section = {"servers": bus.url, "prefix": namespace.prefix}
        Configuration(tardis_config(heartbeat_s))
        composite = create_composite_pool(
            None, interval=30, bus=bus_section if mode == "event" else None
        )
        [pool] = pools(composite)
        remote = getattr(pool, "bus", None)
        bus_task = None
        if remote is not None:
            bus_task = asyncio.create_task(remote.run())
            assert await remote.wait_ready(30), "the bus did not connect"
        rss0 = rss_bytes()
        drones = [pool.factory(drone_uuid=uuid) for uuid in plan.lives]
        pool._hatchery.update(drones)
        pool.demand = n * 8
        rss_drones = rss_bytes()
        t0 = time.time() + 3 + n / 1000
        Fleet.plan, Fleet.t0 = plan, t0
        probe = Probe(plan, t0, covered_by(remote, plan, t0))
        first = drones[0]
        probe.wrap(first.site_agent._site_adapter, first.batch_system_agent._batch_system_adapter)
        agents = None
        if bus is not None:
            spec = {
                "url": bus.url,
                "prefix": bus.namespace.prefix,
                "params": asdict(params),
                "t0": t0,
                "connections": connections,
            }
            agents = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HERE / "_fleet_agents.py"),
                json.dumps(spec),
                stdout=asyncio.subprocess.PIPE,
            )
        tasks: list[asyncio.Task[None]] = []

        async def request() -> None:
            # COBalD asks for each drone 2 s before its job starts (its queue time)
            for drone, life in zip(drones, plan.lives.values(), strict=True):
                await until(t0, life.start - 2.0)
                tasks.append(asyncio.create_task(drone.run()))

        requesting = asyncio.create_task(request())
        liveness = Liveness(remote.registry) if remote is not None else None
        monitor = Monitor(remote)
        monitoring = asyncio.create_task(monitor.run())
        sampler = Sampler(drones, liveness)
        report: dict[str, Any] = {"mode": mode, "drones": n}
        try:
            await until(t0, params.measure_from_s)
            before = sampler.take()
            with profiled(profile, f"{mode}-{n}"):
                await until(t0, params.measure_to_s)
            after = sampler.take()
            report["steady"] = rates(before, after, n)
            report["rss"] = {
                "base_mb": rss0 / 1e6,
                "drones_built_mb": rss_drones / 1e6,
                "measured_mb": after["rss"] / 1e6,
                "per_drone_kb": (after["rss"] - rss0) / n / 1e3,
            }
            report["lag"] = probe.windows(params)
            report["planned_facts_steady"] = plan.in_window(
                params.measure_from_s, params.measure_to_s
            )
            report["calls"] = dict(CALLS)
            report["loop_late"] = monitor.window(before["time"], after["time"])
            report["notes_pending_max_ramp"] = monitor.notes_max
            if liveness is not None:
                ticks = liveness.ticks[before["ticks"] : after["ticks"]]
                report["liveness_tick"] = percentiles(ticks)
            if bus is not None and remote is not None:
                report["storm"] = await storm(bus, remote, plan, probe, sampler, before, after, t0)
                report["waker"] = dict(remote.waker.counts)
                report["bus_counts"] = dict(remote.counts)
                report["notes_pending"] = len(remote.pending_notes)
        finally:
            requesting.cancel()
            monitoring.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if remote is not None and bus_task is not None:
                remote.stop()
                await asyncio.wait_for(bus_task, 30)
            if agents is not None:
                try:  # it ends once its plan is published
                    out, _ = await asyncio.wait_for(agents.communicate(), 30)
                except TimeoutError:
                    agents.terminate()
                    out, _ = await agents.communicate()
                lines = out.decode().strip().splitlines()
                with contextlib.suppress(ValueError, IndexError):
                    report["agents"] = json.loads(lines[-1])
    return report


async def storm(
    bus: _common.Bus,
    remote: Any,
    plan: Plan,
    probe: Probe,
    sampler: Sampler,
    before: dict[str, Any],
    after: dict[str, Any],
    t0: float,
) -> dict[str, Any]:
    """Restart the nats-server; what the reconnects cost and whether any drone was harmed"""
    p = plan.params
    n = p.drones
    start = time.time() - t0
    await bus.server.restart()
    restarted = time.time() - t0
    await until(t0, p.end_s - 2)
    end = time.time() - t0
    last = sampler.take()
    storm_rates = rates(after, last, n)
    steady = rates(before, after, n)
    seconds = last["time"] - after["time"]
    # wakes beyond the facts the plan has each drone publish in the window
    extra_wakes = []
    for life, w0, w1 in zip(plan.lives.values(), after["woken"], last["woken"], strict=True):
        facts = sum(1 for at, _, kind, _ in life.events if start <= at < end and kind in FACTS)
        extra_wakes.append(max(0, (w1 - w0) - facts))
    # the lag's p99 per second of events after the restart began; recovered when it stays low
    buckets: dict[int, list[float]] = {}
    for at, lag, _ in probe.lags:
        if at >= start:
            buckets.setdefault(int(at - start), []).append(lag)
    recovered = 0.0
    for second in sorted(buckets):
        if percentiles(buckets[second])["p99_ms"] >= GOAL_P99_MS:
            recovered = second + 1.0
    harmed = {"lost": 0, "ended": 0, "released_or_drained": 0, "left_available": 0}
    now = time.time() - t0
    for drone, life in plan.lives.items():
        if life.exit <= now + 5 or life.draining <= now:
            continue  # the plan ends or drains it
        view = remote.registry.view(SITE, drone)
        if view is None:
            continue
        harmed["lost"] += bool(view.lost)
        harmed["ended"] += bool(view.ended)
        harmed["released_or_drained"] += view.phase in (RecordPhase.RELEASED, RecordPhase.DRAINED)
        if life.gate < now - 10:
            harmed["left_available"] += remote.tardis_states.get(drone) != "AvailableState"
    return {
        "restart_s": restarted - start,
        "window_s": seconds,
        "state_runs_per_s": storm_rates["state_runs_per_s"],
        "extra_state_runs_per_drone": (storm_rates["state_runs_per_s"] - steady["state_runs_per_s"])
        * seconds
        / n,
        "extra_wakes_per_drone_mean": sum(extra_wakes) / n,
        "extra_wakes_per_drone_max": max(extra_wakes, default=0),
        "drones_over_one_extra_wake": sum(1 for w in extra_wakes if w > 1),
        "recovered_s": recovered,
        "lag_after": probe.window(start, end),
        "cpu_s": storm_rates["cpu_s"],
        "harmed": harmed,
    }


def params_for(
    n: int, mode: str, heartbeat_s: int, measure_s: float, after_s: float, quick: bool
) -> Params:
    """
    The plan of one process: the ramp spread over a heartbeat, so that stock's state runs are
    spread as a pool's grown drones' are; measured once every drone can be Available (stock
    TARDIS takes three heartbeats from a job's start to AvailableState, event-driven a wake)
    and the first payloads started
    """
    ramp = float(heartbeat_s)
    fill = 20.0 if quick else 30.0
    start = ramp + (3.5 * heartbeat_s if mode == "stock" else fill + 10)
    end = start + measure_s + (after_s if mode == "event" else 0.0)
    return Params(
        drones=n,
        ramp_s=ramp,
        fill_s=fill,
        measure_from_s=start,
        measure_to_s=start + measure_s,
        end_s=end,
    )


def run_child(
    mode: str, params: Params, heartbeat_s: int, connections: int, profile: bool
) -> dict[str, Any]:
    spec = {
        "mode": mode,
        "params": asdict(params),
        "heartbeat_s": heartbeat_s,
        "connections": connections,
        "profile": profile,
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        check=True,
        timeout=params.end_s + 240,
    )
    return dict(json.loads(done.stdout.decode().strip().splitlines()[-1]))


def print_report(results: Sequence[dict[str, Any]]) -> None:
    rows: list[list[object]] = []
    for result in results:
        for mode in ("stock", "event"):
            if mode not in result:
                continue
            r = result[mode]
            s, lag = r["steady"], r["lag"]["steady"]
            rows.append(
                [
                    f"{r['drones']:,} {'event-driven' if mode == 'event' else 'stock'}",
                    s["cpu_share"] * 100,
                    s["cpu_us_per_drone_s"],
                    r["rss"]["per_drone_kb"],
                    lag["p50_ms"],
                    lag["p99_ms"],
                    s["state_runs_per_s"],
                    s["batch_calls_per_s"],
                ]
            )
        if "event" not in result or "stock" not in result:
            continue
        e, st = result["event"]["steady"], result["stock"]["steady"]
        rows.append(
            [
                "  event / stock",
                e["cpu_share"] / st["cpu_share"],
                e["cpu_us_per_drone_s"] / st["cpu_us_per_drone_s"],
                result["event"]["rss"]["per_drone_kb"] / result["stock"]["rss"]["per_drone_kb"],
                result["event"]["lag"]["steady"]["p50_ms"]
                / result["stock"]["lag"]["steady"]["p50_ms"],
                result["event"]["lag"]["steady"]["p99_ms"]
                / result["stock"]["lag"]["steady"]["p99_ms"],
                e["state_runs_per_s"] / st["state_runs_per_s"],
                "",
            ]
        )
    print(
        _common.table(
            [
                "drones, mode",
                "CPU % of a core",
                "CPU µs/drone/s",
                "RSS KB/drone",
                "lag p50 ms",
                "lag p99 ms",
                "state runs/s",
                "batch calls/s",
            ],
            rows,
        )
    )
    srows = []
    for result in results:
        s = result.get("event", {}).get("storm")
        if not s:
            continue
        srows.append(
            [
                f"{result['event']['drones']:,}",
                s["restart_s"],
                s["extra_wakes_per_drone_mean"],
                s["extra_wakes_per_drone_max"],
                s["extra_state_runs_per_drone"],
                s["lag_after"]["p99_ms"],
                s["recovered_s"],
                ", ".join(f"{k} {v}" for k, v in s["harmed"].items()),
            ]
        )
    if srows:
        print()
        print(
            _common.table(
                [
                    "storm, drones",
                    "restart s",
                    "extra wakes/drone",
                    "max",
                    "extra runs/drone",
                    "lag p99 ms",
                    "p99 < 100 ms after s",
                    "drones harmed",
                ],
                srows,
            )
        )
    for result in results:
        if "event" not in result or "stock" not in result:
            continue
        e, st = result["event"], result["stock"]
        storm_ = e.get("storm", {})
        print(
            f"goals at {e['drones']:,}: lag p99 < {GOAL_P99_MS:.0f} ms "
            f"{_yes(e['lag']['steady']['p99_ms'] < GOAL_P99_MS)}; CPU/drone <= stock's "
            f"{_yes(e['steady']['cpu_us_per_drone_s'] <= st['steady']['cpu_us_per_drone_s'])}; "
            f"storm <= 1 extra run/drone "
            f"{_yes(storm_.get('extra_state_runs_per_drone', 9) <= 1)}, p99 back < 100 ms within "
            f"{GOAL_RECOVERY_S:.0f} s {_yes(storm_.get('recovered_s', 99) <= GOAL_RECOVERY_S)}"
        )


def _yes(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--drones", type=int, nargs="+", default=None, help="fleet sizes [5000]")
    parser.add_argument("--quick", action="store_true", help="300 drones, shorter windows")
    parser.add_argument("--measure", type=float, default=None, help="measured window s [60]")
    parser.add_argument(
        "--heartbeat", type=int, default=None, help="drone_heartbeat_interval s [60; quick 20]"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["stock", "event"],
        choices=["stock", "event"],
        help="which processes to run [both]",
    )
    parser.add_argument("--after", type=float, default=None, help="window after the storm s [45]")
    parser.add_argument("--connections", type=int, default=100, help="agents' connections [100]")
    parser.add_argument("--profile", action="store_true", help="cProfile the measured window")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        report = asyncio.run(
            child(
                spec["mode"],
                Params(**spec["params"]),
                spec["heartbeat_s"],
                spec["connections"],
                spec["profile"],
            )
        )
        print(json.dumps(report, default=str))
        return 0
    sizes = args.drones or ([300] if args.quick else [5000])
    heartbeat = args.heartbeat or (20 if args.quick else HEARTBEAT_S)
    measure = args.measure or (30.0 if args.quick else 60.0)
    after = args.after or (30.0 if args.quick else 45.0)
    results = []
    started = time.monotonic()
    for n in sizes:
        result: dict[str, Any] = {"heartbeat_s": heartbeat}
        for mode in args.modes:
            params = params_for(n, mode, heartbeat, measure, after, args.quick)
            result[mode] = run_child(mode, params, heartbeat, args.connections, args.profile)
        results.append(result)
    report = {"sizes": sizes, "results": results, "seconds": time.monotonic() - started}
    print(f"{', '.join(f'{n:,}' for n in sizes)} drones, {report['seconds']:.0f} s")
    print_report(results)
    print(f"wrote {_common.write_result('fleet', report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
