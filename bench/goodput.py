"""
Goodput benchmark: the demonstration's controller mode with and without the pool's shrinking rules

Run from the repository root::

    .venv/bin/python bench/goodput.py                # seeds 1-3, about 6 minutes per seed
    .venv/bin/python bench/goodput.py --seeds 1      # one seed

For each seed, one embedded broker runs three sides of ``cobald-remote demo --demand
controller`` in turn (:func:`broker.emulation.demo.command.demo`), with the same payload
arrivals: stock TARDIS; cobald-remote without its shrinking rules (``bus.scale_down_window_s``
and ``bus.utilisation_hold_s`` both 0: COBalD's own ``FactoryPool`` shrinking, a freed slot
free at once); cobald-remote as configured by default (both scaled to the demo's time, 10 s
and 2 s). Supply that can take work and the release order are the same in both cobald-remote
sides: they are not options.

It prints, per seed and summed over the seeds, the work done (payload core-seconds completed,
core-seconds rented while idle, payloads killed, queue wait) and the controller's rows that
the shrinking rules are about (demand-lowering steps while payloads were queued, releases
followed by a demand rise within 10 s), with each cobald-remote side over stock. It writes
JSON to ``bench/results/goodput-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common

from broker.emulation.demo.command import demo
from broker.emulation.demo.run import MODES
from broker.emulation.demo.scenario import Scenario

#: the sides, in the order they run: (name, demo mode, the scenario's shrinking rules off)
SIDES = (("stock", "stock", False), ("without", "remote", True), ("with", "remote", False))

#: (label, path into a run's results); the last element of each is summed over seeds
ROWS = (
    ("payload core-s completed", ("goodput", "payload core-s completed")),
    ("core-s rented while idle", ("goodput", "core-s rented while idle")),
    ("core-s rented", ("goodput", "core-s rented")),
    ("payloads killed", ("payloads", "killed")),
    ("queue wait, mean s", ("queue", "wait_s", "mean")),
    ("queue wait, p90 s", ("queue", "wait_s", "p90")),
    (
        "demand-lowering steps while payloads were queued",
        ("controller", "demand-lowering steps while payloads were queued"),
    ),
    (
        "releases followed by a demand rise within 10 s",
        ("controller", "releases followed by a demand rise within 300 intervals (10 s)"),
    ),
    ("drones released by the pool", ("controller", "drones released by the pool")),
)


def _value(run: dict[str, Any], path: Sequence[str]) -> float:
    value: Any = run
    for key in path:
        value = value[key]
    return float(value)


async def _seed(seed: int, root: Path) -> dict[str, dict[str, Any]]:
    scenario = Scenario(seed=seed, demand="controller")
    plain = dataclasses.replace(scenario, scale_down_window_s=0.0, utilisation_hold_s=0.0)
    runs: dict[str, dict[str, Any]] = {}
    for name, mode, rules_off in SIDES:
        print(f"seed {seed}: {name} ({MODES[mode]})", file=sys.stderr, flush=True)
        # as ``cobald-remote demo`` runs by default: each drone bootstraps its identity
        results = await demo(
            plain if rules_off else scenario,
            [mode],
            root / name,
            progress=lambda _: None,
            bootstrap=True,
        )
        runs[name] = results[mode]
    return runs


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _rows(runs: dict[str, dict[str, Any]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for label, path in ROWS:
        stock, without, with_ = (_value(runs[name], path) for name, _, _ in SIDES)
        rows.append([label, stock, without, _ratio(without, stock), with_, _ratio(with_, stock)])
    return rows


def _summed(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each side's rows summed over the seeds (waits: the mean of the seeds' figures)"""
    summed: dict[str, dict[str, Any]] = {}
    for name, _, _ in SIDES:
        side: dict[str, Any] = {}
        for _, path in ROWS:
            values = [_value(runs[name], path) for runs in per_seed.values()]
            total = sum(values) / len(values) if path[0] == "queue" else sum(values)
            node = side
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = total
        summed[name] = side
    return summed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], metavar="N")
    args = parser.parse_args(argv)
    header = ["row", "stock", "without", "/ stock", "with", "/ stock"]
    started = time.monotonic()
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="cobald-remote-goodput-") as tmp:
        for seed in args.seeds:
            per_seed[seed] = asyncio.run(_seed(seed, Path(tmp) / f"seed-{seed}"))
            print(f"\nseed {seed}")
            print(_common.table(header, _rows(per_seed[seed])), flush=True)
    if len(per_seed) > 1:
        print(f"\nseeds {', '.join(map(str, per_seed))}: summed (queue waits: their mean)")
        print(_common.table(header, _rows(_summed(per_seed))))
    print(f"\n{time.monotonic() - started:.0f} s")
    path = _common.write_result(
        "goodput",
        {
            "seeds": {
                str(seed): {name: runs[name] for name, _, _ in SIDES}
                for seed, runs in per_seed.items()
            }
        },
    )
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
