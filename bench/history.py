"""
History benchmark: a rebuild costs the live fleet, not every drone the site ever ran

Run from the repository root::

    .venv/bin/python bench/history.py           # 100,000 live + 1,000,000 ended drones
    .venv/bin/python bench/history.py --quick   # 10,000 live + 100,000 ended drones

(``bench/scale.py`` measures the live fleet alone, by size; this script what history and
retention add to it.)

Two servers (the embedded one, each in a temporary directory) hold the same live fleet:
one handshake record (``up``) and one heartbeat per live drone, plus ``--retained`` drones
that ended within ``retain_ended_s`` (a ``drained`` record, their lives in the stream).
The *history* server holds before them, in the event stream's retention window, the whole
lives of ``--ended`` drones that ended and were retired (agent started, heartbeat,
drained, agent exiting; their records purged from the bucket as retirement does), stored
longer than the rebuild window ago. The *baseline* server holds the live fleet alone.

Measured on each, in the same run: :func:`broker.manager.rebuild.rebuild` into an empty
registry (seconds, messages read) and the memory it holds (``tracemalloc``); printed as
ratios history / baseline. For reference, on the history server: what reading the last
message of every event subject would read (a no-op :func:`broker.jetstream.reads.read_all`
with ``LAST_PER_SUBJECT``), the cost that grows with the site's history.

Then the retention's own cost: two more servers, one with the live fleet alone (the
baseline), one with ``--outside`` drones beside it that ended within ``retain_ended_s``
(a ``drained`` record and their lives) but longer than the rebuild window ago, as a day of
ends at a busy site under the default retention is: the rebuild reads each of them one by
one (``drones_read``). Writes JSON to ``bench/results/history-<time>.json``. Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import time
import tracemalloc
from collections.abc import Iterator, Mapping

import _common
from _common import Bus
from nats.js.api import ConsumerConfig, DeliverPolicy

from broker.jetstream.reads import read_all
from broker.manager.rebuild import WINDOW_LOST_AFTER, rebuild
from broker.manager.registry import Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace, dedupe_id

SITE = "bench"
LOST_AFTER_S = 5.0  #: the registry's; the rebuild window is a multiple of it


def _snapshot(state: ev.DroneState, at: dt.datetime) -> ev.Snapshot:
    gate_open = state is ev.DroneState.IDLE
    return ev.Snapshot(
        state=state, since=at, gate_open=gate_open, slots=8, worker_pid=4711, started_at=at
    )


def _event(
    kind: type[ev.Event], drone: str, seq: int, state: ev.DroneState, **fields: object
) -> ev.Event:
    at = ev.utcnow()
    return kind(
        site=SITE,
        drone=drone,
        incarnation="inc0",
        seq=seq,
        at=at,
        id=dedupe_id(drone, "inc0", seq),
        snapshot=_snapshot(state, at),
        **fields,  # type: ignore[arg-type]
    )


def life(drone: str) -> Iterator[ev.Event]:
    """A short whole life, as the agent publishes it"""
    yield _event(ev.AgentStarted, drone, 1, ev.DroneState.STARTING, agent_version="b", pid=1)
    yield _event(ev.Heartbeat, drone, 2, ev.DroneState.IDLE, interval_s=30.0)
    yield _event(ev.Drained, drone, 3, ev.DroneState.DRAINED)
    yield _event(ev.AgentExiting, drone, 4, ev.DroneState.EXITING, exit_code=0)


def heartbeat(drone: str) -> ev.Event:
    return _event(ev.Heartbeat, drone, 1, ev.DroneState.IDLE, interval_s=30.0)


async def publish(bus: Bus, events: Iterator[ev.Event]) -> int:
    js = bus.nc.jetstream(publish_async_max_pending=4000)
    ns, n = bus.namespace, 0
    for event in events:
        subject = ns.event(SITE, event.drone, ev.kind_of(type(event)))
        await js.publish_async(subject, ev.encode(event), headers={"Nats-Msg-Id": event.id})
        n += 1
    await asyncio.wait_for(js.publish_async_completed(), 600)
    return n


async def put_records(bus: Bus, drones: list[str], phase: ev.RecordPhase) -> None:
    kv = await bus.nc.jetstream(timeout=60).key_value(bus.namespace.record_bucket)
    sem = asyncio.Semaphore(200)

    async def put(drone: str) -> None:
        record = ev.DroneRecord(
            site=SITE, drone=drone, phase=phase, writer="agent", incarnation="inc0", at=ev.utcnow()
        )
        async with sem:
            # created as the agent's claim creates it (the registry refuses records
            # written without the expected last sequence)
            await kv.create(bus.namespace.record_key(SITE, drone), ev.encode(record))

    await asyncio.gather(*(put(d) for d in drones))


async def retain(bus: Bus, drones: list[str]) -> None:
    """Drones that ended and are kept: a ``drained`` record each and their whole lives"""
    await put_records(bus, drones, ev.RecordPhase.DRAINED)
    await publish(bus, (e for d in drones for e in life(d)))


async def fleet(bus: Bus, live: int, retained: int) -> None:
    """The live fleet and the drones that ended within the retention, as both servers hold them"""
    live_drones = [_common.drone_name(SITE, i) for i in range(live)]
    kept = [_common.drone_name(SITE, live + i) for i in range(retained)]
    started = time.perf_counter()
    await put_records(bus, live_drones, ev.RecordPhase.UP)
    await retain(bus, kept)
    await publish(bus, (heartbeat(d) for d in live_drones))
    print(f"  live fleet written in {time.perf_counter() - started:.0f}s", flush=True)


async def measure(bus: Bus, expected: int) -> dict[str, float]:
    """One rebuild timed, then one under ``tracemalloc`` for the memory it holds"""
    gc.collect()
    registry = Registry(bus.namespace, lost_after_s=LOST_AFTER_S)
    report, _ = await rebuild(bus.nc, bus.js, registry)
    assert len(registry) == expected, (len(registry), expected)
    del registry
    gc.collect()
    tracemalloc.start()
    registry = Registry(bus.namespace, lost_after_s=LOST_AFTER_S)
    await rebuild(bus.nc, bus.js, registry)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "seconds": report.seconds,
        "read": report.window_messages
        + report.drone_messages
        + report.resolved_messages
        + report.records,
        "records": report.records,
        "window_messages": report.window_messages,
        "drones_read": report.drones_read,
        "bytes_per_drone": held / expected,
    }


async def server(live: int, retained: int, ended: int) -> dict[str, object]:
    label = f"history ({ended:,} ended)" if ended else "baseline"
    async with _common.bus(Namespace("bench")) as bus:
        if ended:
            started = time.perf_counter()
            gone = (e for i in range(ended) for e in life(_common.drone_name(SITE, 1 << 36 | i)))
            n = await publish(bus, gone)
            elapsed = time.perf_counter() - started
            print(f"  {label}: {n:,} events of ended drones in {elapsed:.0f}s", flush=True)
            window_s = WINDOW_LOST_AFTER * LOST_AFTER_S
            await asyncio.sleep(window_s + 1)  # the last of them older than the window
        await fleet(bus, live, retained)
        result: dict[str, object] = {"rebuild": await measure(bus, live + retained)}
        print(f"  {label}: rebuild {result['rebuild']}", flush=True)
        if ended:
            started = time.perf_counter()
            every = await read_all(
                bus.nc,
                # creating this consumer takes the server longer than the default 5 s
                bus.nc.jetstream(timeout=600),
                bus.namespace.event_stream,
                ConsumerConfig(
                    deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                    filter_subject=bus.namespace.all_events,
                ),
                lambda *_: None,
                headers=True,
            )
            result["last_per_subject"] = {
                "messages": every,
                "seconds": time.perf_counter() - started,
            }
        info = await bus.js.stream_info(bus.namespace.event_stream)
        result["stream_messages"] = info.state.messages
        print(f"  {label}: {result}", flush=True)
        return result


async def outside(live: int, kept: int) -> dict[str, object]:
    """The live fleet with ``kept`` retained drones that ended before the rebuild window"""
    label = f"outside ({kept:,} retained)" if kept else "live fleet alone"
    async with _common.bus(Namespace("bench")) as bus:
        if kept:
            await retain(bus, [_common.drone_name(SITE, 1 << 37 | i) for i in range(kept)])
            await asyncio.sleep(WINDOW_LOST_AFTER * LOST_AFTER_S + 1)
        await fleet(bus, live, 0)
        result = await measure(bus, live + kept)
        print(f"  {label}: rebuild {result}", flush=True)
        return result


async def run(args: argparse.Namespace) -> dict[str, object]:
    baseline = await server(args.live, args.retained, 0)
    history = await server(args.live, args.retained, args.ended)
    return {
        "live": args.live,
        "retained": args.retained,
        "ended": args.ended,
        "baseline": baseline,
        "history": history,
        "outside": args.outside,
        "live_alone": await outside(args.live, 0),
        "retained_outside": await outside(args.live, args.outside),
    }


def render(report: Mapping[str, object]) -> str:
    base = report["baseline"]["rebuild"]  # type: ignore[index]
    hist = report["history"]["rebuild"]  # type: ignore[index]
    every = report["history"]["last_per_subject"]  # type: ignore[index]
    rows = [
        (key, hist[key], base[key], hist[key] / base[key])
        for key in ("seconds", "read", "bytes_per_drone")
    ]
    lines = [
        f"{report['live']:,} live drones, {report['retained']:,} ended within retention, "
        f"{report['ended']:,} ended and retired in the stream's window",
        _common.table(("rebuild", "history", "baseline", "ratio"), rows),
        "",
        f"reading the last message of every event subject instead: {every['messages']:,} "
        f"messages in {every['seconds']:.2f}s "
        f"({every['seconds'] / hist['seconds']:.1f}x the rebuild's time)",
        "",
        render_outside(report),
    ]
    return "\n".join(lines)


def render_outside(report: Mapping[str, object]) -> str:
    """The retention's row: retained drones outside the window against the live fleet alone"""
    base: Mapping[str, float] = report["live_alone"]  # type: ignore[assignment]
    kept: Mapping[str, float] = report["retained_outside"]  # type: ignore[assignment]
    n = int(report["outside"])  # type: ignore[call-overload]
    rows = [
        (key, kept[key], base[key], kept[key] / base[key] if base[key] else "-")
        for key in ("seconds", "read", "drones_read", "bytes_per_drone")
    ]
    extra_us = (kept["seconds"] - base["seconds"]) / n * 1e6 if n else 0.0
    return "\n".join(
        [
            f"{report['live']:,} live drones and {n:,} retained ended drones outside the "
            "rebuild window (read one by one)",
            _common.table(("rebuild", "retained outside", "live fleet alone", "ratio"), rows),
            f"each retained drone outside the window adds {extra_us:.0f} us to the rebuild",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=int, default=100_000)
    parser.add_argument("--ended", type=int, default=1_000_000)
    parser.add_argument("--retained", type=int, default=1_000)
    parser.add_argument(
        "--outside", type=int, default=25_000, help="retained ended drones outside the window"
    )
    parser.add_argument(
        "--quick", action="store_true", help="10,000 live, 100,000 ended, 2,500 outside"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.live, args.ended, args.retained, args.outside = 10_000, 100_000, 100, 2_500
    report = _common.run_bounded(run(args), 3600)
    print(render(report))
    print(f"written to {_common.write_result('history', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
