"""
Latency benchmark: publish to registry state change, drain request to agent reply

Run from the repository root::

    .venv/bin/python bench/latency.py            # 20 s of load per phase, < 2 min
    .venv/bin/python bench/latency.py --quick    # 5 s of load per phase, < 40 s

It starts its own nats-server (the embedded one, in a temporary directory) and
puts a steady load of ``--rate`` events/s (default 1,000) from ``--drones``
simulated drones (default 10,000) on it, each event published with
``publish_async`` and ``Nats-Msg-Id`` as agents publish them. Two phases:

1. **baseline** (nats-py alone, same server, same load): every event's time from
   ``publish_async`` to the callback of an ordered push consumer (AckNone) on the
   event stream; and, meanwhile, the round trip of a core NATS request to a
   responder that answers at once.
2. **the system**: a real :class:`~broker.manager.service.ManagerService` (rebuild, durable
   pull consumer, registry) and ``--agents`` real in-process
   :class:`~remote_agent.agent.Agent` s (no startd, a sleeping worker). Each event's
   time from ``publish_async`` to the moment the registry applied it (the service's
   own registry, with the time taken right after ``apply_message``); meanwhile
   :meth:`Control.status` round trips to the agents, and one :meth:`Control.drain`
   per agent spread over the load (intent written to the handshake record, then the
   command, then the agent's reply; the command part is timed separately). A drain
   ends its agent, so there is one drain sample per agent.

It prints p50/p99/max with the ratios to the baseline, beside what stock TARDIS's
polled view lags by (configuration, not measured), and writes JSON to
``bench/results/latency-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import _common
from _common import Bus, percentiles
from _latency_load import RESPONDER, paced_load, request_loop
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from broker.manager.control import Control
from broker.manager.outcomes import CommandOutcome, CommandResult
from broker.manager.registry import Applied, Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.manager.validity import UNSTORED, Headers
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace
from remote_agent.settings import Settings

SITE = "bench"
GOAL_EVENT_P99_MS = 10.0
GOAL_DRAIN_P99_MS = 20.0

#: stock TARDIS 0.9.0: how old its view of a drone may be (configuration, not measured)
TARDIS_LAG = [
    (
        "drone_heartbeat_interval",
        60.0,
        "default 60 s: tardis/interfaces/siteadapter.py:26 (SiteConfigurationModel)",
    ),
    (
        "BatchSystem.max_age (HTCondor condor_status cache)",
        60.0,
        "no default in code (required key, minutes, x60 at "
        "tardis/adapters/batchsystems/htcondor.py:229); the documented example and "
        "docs/tardis.md use max_age: 1 = 60 s",
    ),
]


class TimedRegistry(Registry):
    """The registry, noting when each awaited event was applied"""

    def __init__(self, namespace: Namespace, sent: dict[str, float]) -> None:
        super().__init__(namespace)
        self.sent = sent
        self.latencies: list[float] = []

    def apply_message(
        self,
        data: bytes,
        subject: str,
        received_time: float,
        stream_seq: int | None = None,
        headers: Headers = UNSTORED,
    ) -> Applied:
        result = super().apply_message(data, subject, received_time, stream_seq, headers)
        if result is Applied.APPLIED:
            now = time.perf_counter()
            parts = subject.split(".")
            view = self._views.get((parts[1], parts[2]))
            if view is not None and view.event is not None:
                sent = self.sent.pop(view.event.id, None)
                if sent is not None:
                    self.latencies.append(now - sent)
        return result


async def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def baseline(bus: Bus, events: Sequence[ev.Event], rate: float) -> dict[str, object]:
    """nats-py alone: publish → ordered consumer callback; core request → reply"""
    import nats

    sub_nc = await nats.connect(bus.url, pending_size=64 * 1024 * 1024)
    rr_nc = await nats.connect(bus.url)
    sent: dict[str, float] = {}
    acked: list[float] = []
    latencies: list[float] = []
    rtts: list[float] = []
    expected = {e.id for e in events}
    try:
        clock = time.perf_counter

        async def on_event(msg: Msg) -> None:
            now = clock()
            t = sent.pop(msg.headers.get("Nats-Msg-Id", "") if msg.headers else "", None)
            if t is not None:
                latencies.append(now - t)

        sub = await sub_nc.jetstream().subscribe(
            bus.namespace.all_events,
            cb=on_event,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )

        async def respond(msg: Msg) -> None:
            await rr_nc.publish(msg.reply, b"ok")

        await rr_nc.subscribe(RESPONDER, cb=respond)
        await rr_nc.flush()
        stop = asyncio.Event()
        rtts_task = asyncio.create_task(request_loop(bus, rtts, stop))
        seconds = await paced_load(bus, events, rate, sent, acked)
        await wait_for(lambda: len(latencies) >= len(expected), 30, "the baseline subscriber")
        stop.set()
        await rtts_task
        await sub.unsubscribe()
    finally:
        await sub_nc.close()
        await rr_nc.close()
    return {
        "load_seconds": seconds,
        "rate_achieved": len(events) / seconds,
        "event": percentiles(latencies),
        "puback": percentiles(acked),
        "request_reply": percentiles(rtts),
    }


def agent_settings(bus: Bus, i: int) -> Settings:
    settings: Settings = _common.agent_settings(
        bus, SITE, _common.drone_name(SITE, 0xA000000000 + i)
    )
    return settings


async def system(
    bus: Bus, events: Sequence[ev.Event], rate: float, n_agents: int
) -> dict[str, object]:
    """The manager service and real agents under the same load"""
    sent: dict[str, float] = {}
    acked: list[float] = []
    registry = TimedRegistry(bus.namespace, sent)
    service = ManagerService(
        ManagerSettings(servers=(bus.url,), namespace=bus.namespace, durable="bench-latency"),
        registry,
    )
    service_task = asyncio.create_task(service.run())
    agents = [Agent(agent_settings(bus, i)) for i in range(n_agents)]
    agent_tasks = [asyncio.create_task(agent.run()) for agent in agents]
    status_rtts: list[float] = []
    drain_rtts: list[float] = []
    drain_command_rtts: list[float] = []
    outcomes: dict[str, int] = {}
    try:
        await asyncio.wait_for(service.ready.wait(), 60)
        control = service.control
        assert control is not None

        def claimed() -> bool:
            return all(
                (view := registry.view(SITE, a.settings.drone)) is not None
                and view.phase is ev.RecordPhase.UP
                for a in agents
            )

        await wait_for(claimed, 60, "the agents' claims")
        # time the command part of each drain (the rest is the handshake record's write)
        command = control.command

        async def timed_command(cmd: ev.AnyCommand) -> CommandResult:
            t = time.perf_counter()
            result = await command(cmd)
            if isinstance(cmd, ev.DrainCommand):
                drain_command_rtts.append(time.perf_counter() - t)
            return result

        control.command = timed_command  # type: ignore[method-assign,assignment]
        stop = asyncio.Event()
        drained: set[str] = set()
        status_task = asyncio.create_task(status_loop(control, agents, drained, status_rtts, stop))
        drain_task = asyncio.create_task(
            drain_loop(control, agents, drained, drain_rtts, outcomes, len(events) / rate)
        )
        seconds = await paced_load(bus, events, rate, sent, acked)
        await wait_for(lambda: not sent, 30, "the registry to apply every event")
        stop.set()
        await status_task
        await drain_task
        await asyncio.wait_for(asyncio.gather(*agent_tasks, return_exceptions=True), 60)
        rejected = registry.metrics().rejected_total
    finally:
        for agent, task in zip(agents, agent_tasks, strict=True):
            if not task.done():
                agent.request_stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*agent_tasks, return_exceptions=True), 30)
        service.stop()
        await asyncio.wait_for(service_task, 30)
    return {
        "load_seconds": seconds,
        "rate_achieved": len(events) / seconds,
        "event": percentiles(registry.latencies),
        "puback": percentiles(acked),
        "status": percentiles(status_rtts),
        "drain": percentiles(drain_rtts),
        "drain_command": percentiles(drain_command_rtts),
        "drain_samples_ms": [round(x * 1e3, 3) for x in drain_rtts],
        "drain_command_samples_ms": [round(x * 1e3, 3) for x in drain_command_rtts],
        "drain_outcomes": outcomes,
        "rejected": rejected,
        "agents": n_agents,
    }


async def status_loop(
    control: Control,
    agents: Sequence[Agent],
    drained: set[str],
    rtts: list[float],
    stop: asyncio.Event,
) -> None:
    """Control.status to each agent not drained yet in turn, 100 per second"""
    i = 0
    while not stop.is_set():
        agent = agents[i % len(agents)]
        i += 1
        if agent.settings.drone in drained:
            if len(drained) == len(agents):
                return
            continue
        t = time.perf_counter()
        result = await control.status(SITE, agent.settings.drone)
        if result.outcome is CommandOutcome.ANSWERED:
            rtts.append(time.perf_counter() - t)
        elif agent.settings.drone not in drained:  # drained meanwhile: its agent may be gone
            raise RuntimeError(f"status of {agent.settings.drone}: {result.outcome}")
        await asyncio.sleep(0.01)


async def drain_loop(
    control: Control,
    agents: Sequence[Agent],
    drained: set[str],
    rtts: list[float],
    outcomes: dict[str, int],
    seconds: float,
) -> None:
    """One Control.drain per agent (it ends the agent), spread evenly over the load"""
    gap = seconds / (len(agents) + 1)
    for agent in agents:
        await asyncio.sleep(gap)
        drained.add(agent.settings.drone)
        t = time.perf_counter()
        result = await control.drain(SITE, agent.settings.drone, reason="bench")
        rtts.append(time.perf_counter() - t)
        outcomes[str(result.outcome)] = outcomes.get(str(result.outcome), 0) + 1


async def run(args: argparse.Namespace) -> dict[str, object]:
    n = int(args.rate * args.seconds)
    print(f"building 2 x {n:,} events from {args.drones:,} drones ...", flush=True)
    first = _common.fleet_events(n, args.drones, SITE, seed=1, first_seq=1_000_000)
    second = _common.fleet_events(n, args.drones, SITE, seed=2, first_seq=2_000_000)
    async with _common.bus(Namespace("bench")) as bus:
        print(f"baseline: {args.rate:,.0f} events/s for {args.seconds:g} s ...", flush=True)
        base = await baseline(bus, first, args.rate)
        print(f"system: manager service + {args.agents} agents, same load ...", flush=True)
        measured = await system(bus, second, args.rate, args.agents)
    ev_p99 = measured["event"]["p99_ms"]  # type: ignore[index]
    drain_p99 = measured["drain"]["p99_ms"]  # type: ignore[index]
    status_p99 = measured["status"]["p99_ms"]  # type: ignore[index]
    return {
        "benchmark": "latency",
        "rate": args.rate,
        "drones": args.drones,
        "seconds_per_phase": args.seconds,
        "baseline": base,
        "system": measured,
        "tardis_lag_config_s": {name: value for name, value, _ in TARDIS_LAG},
        "tardis_lag_sources": {name: source for name, _, source in TARDIS_LAG},
        "goals": {"event_p99_ms": GOAL_EVENT_P99_MS, "drain_p99_ms": GOAL_DRAIN_P99_MS},
        "met": {
            "event_p99": ev_p99 < GOAL_EVENT_P99_MS,
            "drain_p99": drain_p99 < GOAL_DRAIN_P99_MS,
            "status_p99": status_p99 < GOAL_DRAIN_P99_MS,
        },
    }


def render(report: dict[str, object]) -> str:
    base, sys_ = report["baseline"], report["system"]
    assert isinstance(base, dict) and isinstance(sys_, dict)
    rows: list[list[object]] = []

    def row(name: str, p: dict[str, float], ref: dict[str, float] | None) -> None:
        ratio50 = f"{p['p50_ms'] / ref['p50_ms']:.1f}x" if ref else "baseline"
        ratio99 = f"{p['p99_ms'] / ref['p99_ms']:.1f}x" if ref else ""
        rows.append(
            [name, int(p["count"]), p["p50_ms"], p["p99_ms"], p["max_ms"], ratio50, ratio99]
        )

    row("js.publish -> ordered consumer cb (nats-py)", base["event"], None)
    row("publish -> registry applied (ManagerService)", sys_["event"], base["event"])
    row("core request -> reply (instant responder)", base["request_reply"], None)
    row("Control.status -> agent reply", sys_["status"], base["request_reply"])
    row("Control.drain (KV intent + command) -> reply", sys_["drain"], base["request_reply"])
    row("  of which the drain command -> reply", sys_["drain_command"], base["request_reply"])
    row("publish -> PubAck (baseline phase)", base["puback"], None)
    row("publish -> PubAck (system phase)", sys_["puback"], base["puback"])
    header = ["latency (ms)", "samples", "p50", "p99", "max", "p50 ratio", "p99 ratio"]
    lines = [_common.table(header, rows)]
    met = report["met"]
    assert isinstance(met, dict)
    lines.append(
        f"load: {report['rate']:,} events/s from {report['drones']:,} drones, achieved "
        f"{base['rate_achieved']:,.0f}/s (baseline) and {sys_['rate_achieved']:,.0f}/s "
        f"(system); {sys_['agents']} real agents; drain outcomes {sys_['drain_outcomes']}"
    )
    lines.append(
        f"goals: event p99 < {GOAL_EVENT_P99_MS:g} ms: "
        f"{'met' if met['event_p99'] else 'NOT met'}; drain reply p99 < "
        f"{GOAL_DRAIN_P99_MS:g} ms: {'met' if met['drain_p99'] else 'NOT met'} "
        f"(status: {'met' if met['status_p99'] else 'NOT met'})"
    )
    total = sum(value for _, value, _ in TARDIS_LAG)
    lines.append(
        f"stock TARDIS polled view, by configuration (not measured): up to {total:.0f} s "
        f"= {' + '.join(f'{name} {value:.0f} s' for name, value, _ in TARDIS_LAG)}"
    )
    lines.extend(f"  {name}: {source}" for name, _, source in TARDIS_LAG)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s (1,000)")
    parser.add_argument("--drones", type=int, default=10_000, help="simulated drones (10,000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="load per phase (20 s)")
    parser.add_argument("--agents", type=int, default=50, help="real in-process agents (50)")
    parser.add_argument("--quick", action="store_true", help="5 s per phase, 20 agents")
    parser.add_argument("--budget", type=float, default=170.0, help="give up after (s)")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.agents, args.budget = 5.0, 20, 38.0
    report = _common.run_bounded(run(args), args.budget)
    print(render(report))
    print(f"written {_common.write_result('latency', report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
