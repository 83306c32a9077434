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
manager publishes, :class:`~broker.tardis.plugin.TardisStateNotes`):

* gate open (the agent's ``gate_opened``: its startd can take work, and TARDIS's answers say
  Running and Available from then on) -> ``IntegratingState`` and -> ``AvailableState``;
* ``drained`` -> ``DownState`` (includes the agent's own ending) and ``agent_exiting`` ->
  ``DownState``.

It prints count/p50/p99/max per mode with the ratio heartbeat-only / event-driven and
writes JSON to ``bench/results/lag-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import _common
from _common import percentiles
from _tardis import ROWS, BenchSite, BlindOverlay, States, lags, read_stream, wait_for
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.resources.drone import Drone

from broker.tardis.drone import EventDrone
from broker.tardis_adapter import (
    BusConfig,
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.protocol.names import Namespace

SITE_NAME = "Bench"
SITE = "bench"
GOAL_P99_MS = 100.0
GOAL_RATIO = 100.0


async def drain_all(remote: RemoteBus, drones: Sequence[str], spread_s: float, seed: int) -> None:
    rng = random.Random(seed)
    control = remote.control
    assert control is not None

    async def drain(drone: str) -> None:
        await asyncio.sleep(rng.uniform(0, spread_s))
        await control.drain(SITE, drone, remote.drain_deadline(), "bench")

    await asyncio.gather(*(drain(drone) for drone in drones))


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
        site = BenchSite(
            lambda drone: _common.agent_settings(bus, SITE, drone, 30.0),
            heartbeat_s,
            rng,
            SITE_NAME,
        )
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
        messages = await read_stream(bus.nc, namespace, SITE, set(uuids))
    report: dict[str, Any] = {
        "drones_per_mode": n,
        "heartbeat_s": heartbeat_s,
        "seed": seed,
        "seconds": seconds,
        "modes": {},
    }
    for mode, drones in modes.items():
        names = {d.resource_attributes.drone_uuid for d in drones}
        report["modes"][mode] = {
            row: percentiles([lag for _, lag in found])
            for row, found in lags(messages, names).items()
        }
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
