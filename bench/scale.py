"""
Scale benchmark: registry memory per drone, rebuild time, handshake operations per second

Run from the repository root::

    .venv/bin/python bench/scale.py            # 10,000 and 100,000 drones, < 3 min
    .venv/bin/python bench/scale.py --quick    # 10,000 drones, fewer handshakes, < 40 s

For each fleet size it starts its own nats-server (the embedded one, in a
temporary directory) and fills the event stream the way a running fleet leaves
it: one heartbeat per drone (with its full snapshot), then a tail of half as many
realistic events (payload starts and ends with up to 8 payloads, heartbeats).
Then, against baselines measured in the same run:

* **memory per drone**: the same messages applied with
  :meth:`Registry.apply_message`, traced with ``tracemalloc`` (every byte the
  registry allocated and still holds, divided by the drones); baseline: a plain
  dict ``{(site, drone): <copy of the newest raw msgpack bytes>}``. The resident
  memory growth over the rebuild is shown beside it (coarser: allocator reuse).
* **rebuild after a restart**: :func:`broker.manager.rebuild.rebuild` into an empty
  registry (the handshake bucket ``LAST_PER_SUBJECT``, then every event stored within
  its window, which here is every event); baselines: nats-py alone reading the same
  messages with an ordered push consumer (AckNone, same delivery policies), and the
  project's own reader (:func:`broker.jetstream.reads.read_all`) with a handler that
  does nothing, which separates reading from decoding and applying.
* **handshake operations per second** (one server, ``--inflight`` concurrent
  operations on distinct drones): :meth:`RecordStore.release` and
  :meth:`RecordStore.claim` of new records, against plain ``kv.put`` of the same
  number of records of the same size at the same concurrency.

It prints a table with the ratios and writes JSON to
``bench/results/scale-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import _common
import nats
from _common import Bus
from _scale_memory import SITE, busy_heartbeats, memory, record_values, rss_bytes
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from broker.jetstream.reads import read_all
from broker.manager.rebuild import rebuild
from broker.manager.registry import Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import Namespace

GOAL_BYTES_PER_DRONE = 2048
GOAL_REBUILD_S = 5.0
GOAL_REBUILD_AT = 100_000


def fleet(n_drones: int) -> list[tuple[str, bytes, str]]:
    """(subject, data, id): one heartbeat per drone, then a tail of n/2 realistic events"""
    ns = Namespace("bench")
    beats = _common.fleet_events(
        n_drones, n_drones, SITE, seed=3, round_robin=True, heartbeats_only=True
    )
    tail = _common.fleet_events(n_drones // 2, n_drones, SITE, seed=4, first_seq=2_000_000)
    return [
        (ns.event(e.site, e.drone, ev.kind_of(type(e))), ev.encode(e), e.id) for e in beats + tail
    ]


async def publish(bus: Bus, messages: Sequence[tuple[str, bytes, str]]) -> float:
    js = bus.nc.jetstream(publish_async_max_pending=4000)
    started = time.perf_counter()
    for subject, data, event_id in messages:
        await js.publish_async(subject, data, headers={"Nats-Msg-Id": event_id})
    await asyncio.wait_for(js.publish_async_completed(), 120)
    return time.perf_counter() - started


async def ordered_read(
    bus: Bus, filter_subject: str, policy: DeliverPolicy, start: int | None, wanted: int
) -> float:
    """nats-py alone: read ``wanted`` messages with an ordered push consumer; seconds"""
    if wanted == 0:
        return 0.0
    nc = await nats.connect(bus.url, pending_size=256 * 1024 * 1024)
    done = asyncio.Event()
    count = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal count
        count += 1
        if count >= wanted:
            done.set()

    try:
        started = time.perf_counter()
        sub = await nc.jetstream().subscribe(
            filter_subject,
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=policy,
            config=None
            if start is None
            else _start_config(start),  # BY_START_SEQUENCE needs opt_start_seq
        )
        await asyncio.wait_for(done.wait(), 120)
        seconds = time.perf_counter() - started
        await sub.unsubscribe()
    finally:
        await nc.close()
    return seconds


def _start_config(start: int) -> ConsumerConfig:
    return ConsumerConfig(opt_start_seq=start)


async def noop_read(
    bus: Bus, filter_subject: str, policy: DeliverPolicy, start: int, stream: str | None = None
) -> float:
    """The project's own reader (read_all, direct dispatch) with a handler that does nothing"""
    config = ConsumerConfig(deliver_policy=policy, filter_subject=filter_subject)
    if policy is DeliverPolicy.BY_START_SEQUENCE:
        config.opt_start_seq = start
    started = time.perf_counter()
    stream = stream or bus.namespace.event_stream
    await read_all(bus.nc, bus.js, stream, config, lambda *_: None, headers=True)
    return time.perf_counter() - started


async def fleet_size(n_drones: int) -> dict[str, object]:
    print(f"{n_drones:,} drones: building events ...", flush=True)
    messages = fleet(n_drones)
    async with _common.bus(Namespace("bench")) as bus:
        published = await publish(bus, messages)
        records_s = await fill_records(bus, n_drones)
        print(
            f"  published {len(messages):,} events in {published:.1f}s, {n_drones:,} records "
            f"in {records_s:.1f}s; rebuilding ...",
            flush=True,
        )
        gc.collect()
        rss0 = rss_bytes()
        registry = Registry(bus.namespace)
        report, _feed = await rebuild(bus.nc, bus.js, registry)
        gc.collect()
        rss_delta = rss_bytes() - rss0
        assert len(registry) == n_drones, (len(registry), n_drones)
        del registry
        gc.collect()
        ns = bus.namespace
        print("  baselines: ordered consumer, read_all no-op ...", flush=True)
        # the rebuild reads the bucket, then every event of its window: here all of them
        raw_s = await ordered_read(bus, ns.all_events, DeliverPolicy.ALL, None, report.events)
        kv_stream, kv_subjects = f"KV_{ns.record_bucket}", f"$KV.{ns.record_bucket}.>"
        raw_s += await ordered_read(
            bus, kv_subjects, DeliverPolicy.LAST_PER_SUBJECT, None, report.records
        )
        noop_s = await noop_read(bus, ns.all_events, DeliverPolicy.ALL, 0)
        noop_s += await noop_read(
            bus, kv_subjects, DeliverPolicy.LAST_PER_SUBJECT, 0, stream=kv_stream
        )
    print("  memory (tracemalloc) ...", flush=True)
    mem = memory(messages, n_drones)
    busy = memory(busy_heartbeats(n_drones), n_drones)
    return {
        "drones": n_drones,
        "messages": len(messages),
        "publish_s": published,
        "rebuild": {
            "seconds": report.seconds,
            "events_s": report.events_s,
            "resolve_s": report.resolve_s,
            "records_s": report.records_s,
            "events": report.events,
            "resolved": report.resolved,
            "records": report.records,
        },
        "ordered_consumer_read_s": raw_s,
        "read_all_noop_s": noop_s,
        "rss_delta_bytes_per_drone": rss_delta / n_drones,
        **mem,
        "all_busy_8_payloads": busy,
    }


async def fill_records(bus: Bus, n_drones: int, inflight: int = 200) -> float:
    """One ``UP`` handshake record per drone, as a running fleet has; seconds taken"""
    kv = await bus.js.key_value(bus.namespace.record_bucket)
    values = record_values(n_drones)

    async def put(i: int) -> None:
        await kv.create(*values[i])  # as the agent's claim writes it

    return n_drones / await concurrently(n_drones, inflight, put)


async def concurrently(
    n: int, inflight: int, operation: Callable[[int], Awaitable[object]]
) -> float:
    """Run ``operation(0..n-1)`` with ``inflight`` at a time; operations per second"""
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            await operation(i)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(inflight):
            tg.create_task(worker())
    return n / (time.perf_counter() - started)


async def handshakes(n: int, inflight: int) -> dict[str, object]:
    """RecordStore.release and .claim of new records vs kv.put, ``inflight`` at a time"""
    async with _common.bus(Namespace("bench")) as bus:
        store = await RecordStore.open(bus.js, bus.namespace)
        kv = store.kv
        size = len(
            ev.encode(
                ev.DroneRecord(
                    site=SITE,
                    drone=_common.drone_name(SITE, 0),
                    phase=ev.RecordPhase.UP,
                    writer="agent",
                    incarnation="0123456789ab",
                    at=ev.utcnow(),
                )
            )
        )
        value = b"x" * size

        def drone(base: int, i: int) -> str:
            return _common.drone_name(SITE, base + i)

        rates: dict[str, float] = {}
        rates["kv.put (baseline)"] = await concurrently(
            n, inflight, lambda i: kv.put(store.key(SITE, drone(0x1000000000, i)), value)
        )
        rates["RecordStore.release (new record)"] = await concurrently(
            n, inflight, lambda i: store.release(SITE, drone(0x2000000000, i), note="bench")
        )
        rates["RecordStore.claim (new record)"] = await concurrently(
            n, inflight, lambda i: store.claim(SITE, drone(0x3000000000, i), "0123456789ab")
        )
        rates["RecordStore.claim (new incarnation)"] = await concurrently(
            n, inflight, lambda i: store.claim(SITE, drone(0x3000000000, i), "ba9876543210")
        )
    return {"operations": n, "inflight": inflight, "record_bytes": size, "per_second": rates}


async def run(args: argparse.Namespace) -> dict[str, object]:
    sizes = [await fleet_size(n) for n in args.drones]
    print(f"handshakes: {args.handshakes:,} each, {args.inflight} in flight ...", flush=True)
    hs = await handshakes(args.handshakes, args.inflight)
    at_goal = [s for s in sizes if s["drones"] == GOAL_REBUILD_AT]
    met: dict[str, object] = {
        "bytes_per_drone": all(
            float(s["registry_with_record_bytes_per_drone"]) < GOAL_BYTES_PER_DRONE  # type: ignore[arg-type]
            for s in sizes
        ),
        "bytes_per_drone_all_busy": all(
            s["all_busy_8_payloads"]["registry_bytes_per_drone"] < GOAL_BYTES_PER_DRONE  # type: ignore[index]
            for s in sizes
        ),
        "rebuild_at_100k": (
            at_goal[0]["rebuild"]["seconds"] < GOAL_REBUILD_S  # type: ignore[index]
            if at_goal
            else "not measured (--quick)"
        ),
    }
    return {
        "benchmark": "scale",
        "sizes": sizes,
        "handshake": hs,
        "goals": {
            "bytes_per_drone": GOAL_BYTES_PER_DRONE,
            "rebuild_s": GOAL_REBUILD_S,
            "rebuild_at": GOAL_REBUILD_AT,
        },
        "met": met,
    }


def render(report: Mapping[str, object]) -> str:
    sizes = report["sizes"]
    assert isinstance(sizes, list)
    lines = []
    rows: list[list[object]] = []
    for s in sizes:
        reg, raw = s["registry_bytes_per_drone"], s["raw_dict_bytes_per_drone"]
        rows.append(
            [f"{s['drones']:,} drones", reg, raw, f"{reg / raw:.1f}x",
             s["raw_msgpack_bytes_per_drone"], s["rss_delta_bytes_per_drone"]]
        )  # fmt: skip
        reg, raw = (
            s["registry_with_record_bytes_per_drone"],
            s["raw_dict_with_record_bytes_per_drone"],
        )
        rows.append(
            [f"{s['drones']:,} drones, + handshake record", reg, raw, f"{reg / raw:.1f}x", "-", "-"]
        )  # fmt: skip
        busy = s["all_busy_8_payloads"]
        reg, raw = busy["registry_bytes_per_drone"], busy["raw_dict_bytes_per_drone"]
        rows.append(
            [f"{s['drones']:,} drones, all busy (8 payloads)", reg, raw, f"{reg / raw:.1f}x",
             busy["raw_msgpack_bytes_per_drone"], "-"]
        )  # fmt: skip
    lines.append(
        _common.table(
            ["memory (bytes/drone)", "registry", "raw dict", "ratio", "msgpack", "RSS delta"],
            rows,
        )
    )
    rows = []
    for s in sizes:
        rb = s["rebuild"]
        rows.append(
            [f"{s['drones']:,} drones", s["messages"], rb["events"], rb["resolved"],
             rb["records"],
             rb["seconds"], s["ordered_consumer_read_s"], s["read_all_noop_s"],
             f"{rb['seconds'] / s['ordered_consumer_read_s']:.2f}x",
             f"{rb['events_s']:.2f}/{rb['resolve_s']:.2f}/{rb['records_s']:.2f}"]
        )  # fmt: skip
    lines.append("")
    lines.append(
        _common.table(
            ["rebuild (s)", "stored", "events read", "resolved", "records", "rebuild",
             "ordered raw", "read_all no-op", "ratio", "events/resolve/records"],
            rows,
        )
    )  # fmt: skip
    hs = report["handshake"]
    assert isinstance(hs, dict)
    rates = hs["per_second"]
    base = rates["kv.put (baseline)"]
    lines.append("")
    lines.append(
        _common.table(
            [f"handshake ops/s ({hs['operations']:,} each, {hs['inflight']} in flight)",
             "ops/s", "ratio"],
            [[name, rate, "baseline" if rate == base else f"{rate / base:.2f}x"]
             for name, rate in rates.items()],
        )
    )  # fmt: skip
    met = report["met"]
    assert isinstance(met, dict)
    lines.append(
        f"goals: < {GOAL_BYTES_PER_DRONE} bytes/drone (events + record): "
        f"{'met' if met['bytes_per_drone'] else 'NOT met'} "
        f"(all busy: {'met' if met['bytes_per_drone_all_busy'] else 'NOT met'}); "
        f"rebuild < {GOAL_REBUILD_S:g} s at "
        f"{GOAL_REBUILD_AT:,} drones: "
        + (
            met["rebuild_at_100k"]
            if isinstance(met["rebuild_at_100k"], str)
            else ("met" if met["rebuild_at_100k"] else "NOT met")
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--drones", type=int, nargs="+", default=[10_000, 100_000], help="fleet sizes"
    )
    parser.add_argument("--handshakes", type=int, default=20_000, help="operations of each kind")
    parser.add_argument("--inflight", type=int, default=200, help="concurrent operations")
    parser.add_argument("--quick", action="store_true", help="10,000 drones, 3,000 handshakes")
    parser.add_argument("--budget", type=float, default=175.0, help="give up after (s)")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.drones, args.handshakes, args.budget = [10_000], 3_000, 38.0
    report = _common.run_bounded(run(args), args.budget)
    print(render(report))
    print(f"written {_common.write_result('scale', report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
