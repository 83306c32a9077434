"""
The fleet benchmark's agents: every drone's life as a plan, and a process that publishes it

Both of ``fleet.py``'s processes compute the same :class:`Plan` from the same arguments: the
simulated agents' process publishes it on the bus at its times, and the benchmark's fake site
and overlay (``_fleet_site.py``) answer from it, so stock TARDIS sees the same fleet through its
adapters that the event-driven drones see through the agents' events.

A drone's life (times from the plan's start): its job starts within the ramp, the agent
announces itself (``agent_started``, ``worker_started``, ``startd_ready``, ``gate_opened``), it
heartbeats every 30 s from a random phase, each of its 8 slots runs payloads of an exponential
runtime (``payload_s`` on average) with a short gap between them, the first within ``fill_s``
of the gate opening; a share of the drones (``drain_share``) drains within the measured window:
``draining``, its payloads end within 5-30 s, ``drained``, ``agent_exiting``, and its batch job
ends a second later.

Run as a script it is the agents' process (``python bench/_fleet_agents.py <json>``): every
drone on one of ``connections`` connections, each event published when due (core NATS with
``Nats-Msg-Id``; the stream stores it). When a connection comes back after an outage, each of
its drones sends again what an agent sends after a reconnect: its newest event (the same id)
and a heartbeat with its whole snapshot. It prints a JSON line with what it did.
"""

from __future__ import annotations

import asyncio
import bisect
import datetime as dt
import heapq
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import _common
import nats

from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace, dedupe_id

SITE = "fleet"
SLOTS = 8
HEARTBEAT_S = 30.0
#: kinds whose facts TARDIS reads (every one but the heartbeat)
FACTS = ("gate_opened", "payload_started", "payload_finished", "draining", "drained", "agent_exiting")
#: a drone's seq of its k-th planned event; the ones between are for resent heartbeats
SEQ_STEP = 4


@dataclass(frozen=True)
class Params:
    """What a plan is made of (times in seconds from its start)"""

    drones: int
    seed: int = 1
    ramp_s: float = 20.0
    fill_s: float = 60.0
    payload_s: float = 1800.0
    gap_s: float = 10.0
    measure_from_s: float = 90.0
    measure_to_s: float = 210.0
    end_s: float = 260.0
    drain_share: float = 0.02


@dataclass
class Life:
    """One drone's plan: its events ``(at, seq, kind, busy slots)`` and when its job runs"""

    drone: str
    start: float
    gate: float
    exit: float = float("inf")
    draining: float = float("inf")
    drained: float = float("inf")
    events: list[tuple[float, int, str, int]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # the events' at, for bisect

    def newest(self, t: float) -> int:
        """Index of the newest event at or before ``t`` (-1: none yet)"""
        return bisect.bisect_right(self.times, t) - 1


def drone_uuid(i: int) -> str:
    return f"{SITE}-{i:06d}"


class Plan:
    """Every drone's :class:`Life`, deterministic in :class:`Params`"""

    def __init__(self, params: Params) -> None:
        self.params = params
        self.lives: dict[str, Life] = {}
        rng = random.Random(params.seed)
        n = params.drones
        draining = set(rng.sample(range(n), round(n * params.drain_share)))
        for i in range(n):
            self.lives[drone_uuid(i)] = self._life(i, rng, i in draining)

    def _life(self, i: int, rng: random.Random, drains: bool) -> Life:
        p = self.params
        start = p.ramp_s * i / p.drones + rng.uniform(0, 0.5)
        gate = start + rng.uniform(0.5, 2.0)
        life = Life(drone_uuid(i), start, gate)
        changes: list[tuple[float, str, int]] = [  # (at, kind, +1/-1 busy)
            (start, "agent_started", 0),
            (start + 0.1, "worker_started", 0),
            (gate - 0.1, "startd_ready", 0),
            (gate, "gate_opened", 0),
        ]
        end = p.end_s
        if drains:
            life.draining = rng.uniform(p.measure_from_s, p.measure_to_s - 40)
            life.drained = life.draining + rng.uniform(5, 30)
            life.exit = life.drained + 1.0
            changes.append((life.draining, "draining", 0))
            end = life.drained
        for _ in range(SLOTS):
            t = gate + rng.uniform(0, p.fill_s)
            while t < end:
                stop = t + rng.expovariate(1 / p.payload_s)
                if drains and t >= life.draining:
                    break
                changes.append((t, "payload_started", 1))
                if stop >= end:
                    if drains:
                        changes.append((life.drained - 0.05, "payload_finished", -1))
                    break
                changes.append((stop, "payload_finished", -1))
                t = stop + rng.expovariate(1 / p.gap_s)
        if drains:
            changes.append((life.drained, "drained", 0))
            changes.append((life.drained + 0.5, "agent_exiting", 0))
        beat = start + rng.uniform(0.2, HEARTBEAT_S)
        while beat < min(p.end_s, life.exit - 0.6):
            changes.append((beat, "heartbeat", 0))
            beat += HEARTBEAT_S
        changes.sort()
        busy = 0
        for k, (at, kind, delta) in enumerate(changes):
            busy += delta
            life.events.append((at, (k + 1) * SEQ_STEP, kind, busy))
            life.times.append(at)
        return life

    def in_window(self, lo: float, hi: float) -> int:
        """How many fact events (not heartbeats) are planned in ``[lo, hi)``"""
        return sum(
            1 for life in self.lives.values() for at, _, kind, _ in life.events
            if lo <= at < hi and kind != "heartbeat"
        )


# ---------------------------------------------------------------- the agents' process


def _state(kind: str, busy: int, draining: bool) -> ev.DroneState:
    if kind == "agent_exiting":
        return ev.DroneState.EXITING
    if kind == "drained":
        return ev.DroneState.DRAINED
    if draining:
        return ev.DroneState.DRAINING
    return {
        "agent_started": ev.DroneState.STARTING,
        "worker_started": ev.DroneState.WORKER_UP,
        "startd_ready": ev.DroneState.STARTD_READY,
    }.get(kind, ev.DroneState.BUSY if busy else ev.DroneState.IDLE)


class Agent:
    """One simulated agent: builds its drone's events as its real agent would"""

    def __init__(self, life: Life, t0: float) -> None:
        self.life = life
        self.t0 = t0
        self.started = dt.datetime.fromtimestamp(t0 + life.start, dt.UTC)
        self.payloads: list[ev.Payload] = []
        self.since = self.started
        self.state: ev.DroneState | None = None
        self.last: tuple[str, bytes, str] | None = None  # subject, data, id
        self.resent = 0

    def event(self, k: int, at: dt.datetime, kind: str | None = None, seq: int = 0) -> ev.Event:
        _, planned_seq, planned_kind, busy = self.life.events[k]
        kind = kind or planned_kind
        seq = seq or planned_seq
        draining = at.timestamp() - self.t0 >= self.life.draining
        job = f"{self.life.drone}.{planned_seq}"
        if kind == "payload_started":
            self.payloads.append(ev.Payload(job_id=job, slot=f"slot1_{len(self.payloads) + 1}", started_at=at))
        elif kind == "payload_finished" and self.payloads:
            job = self.payloads.pop(0).job_id
        state = _state(kind, len(self.payloads), draining)
        if state is not self.state:
            self.state, self.since = state, at
        snapshot = ev.Snapshot(
            state=state,
            since=self.since,
            gate_open=state in (ev.DroneState.IDLE, ev.DroneState.BUSY),
            slots=SLOTS,
            payloads=list(self.payloads),
            worker_pid=4711,
            started_at=self.started,
        )
        head: dict[str, Any] = {
            "site": SITE,
            "drone": self.life.drone,
            "incarnation": "inc0",
            "seq": seq,
            "at": at,
            "id": dedupe_id(self.life.drone, "inc0", seq),
            "snapshot": snapshot,
        }
        if kind == "heartbeat":
            return ev.Heartbeat(**head, interval_s=HEARTBEAT_S)
        if kind == "payload_started":
            return ev.PayloadStarted(**head, job_id=job, slot="slot1_1")
        if kind == "payload_finished":
            return ev.PayloadFinished(**head, job_id=job, how=ev.PayloadEnd.EXIT, exit_code=0)
        if kind == "agent_started":
            return ev.AgentStarted(**head, agent_version="bench", pid=4711)
        if kind == "worker_started":
            return ev.WorkerStarted(**head, pid=4711, command=["sleep"])
        if kind == "startd_ready":
            return ev.StartdReady(**head, slots=SLOTS)
        if kind == "gate_opened":
            return ev.GateOpened(**head)
        if kind == "draining":
            return ev.Draining(**head, payloads=len(self.payloads), deadline=at + dt.timedelta(minutes=10))
        if kind == "drained":
            return ev.Drained(**head)
        return ev.AgentExiting(**head, exit_code=0)


async def publish_plan(
    url: str, prefix: str, params: Params, t0: float, connections: int
) -> dict[str, Any]:
    """Publish every planned event when it is due; resend after each reconnect"""
    plan = Plan(params)
    ns = Namespace(prefix)
    agents = [Agent(life, t0) for life in plan.lives.values()]
    counts = {"published": 0, "resent": 0, "reconnects": 0, "refused": 0, "errors": 0, "disconnects": 0}
    late: list[float] = []
    ncs: list[Any] = []
    groups: list[list[Agent]] = [agents[c::connections] for c in range(connections)]

    outboxes: list[list[tuple[str, bytes, str]]] = [[] for _ in range(connections)]

    def send(c: int, agent: Agent, event: ev.Event) -> None:
        subject = ns.event(SITE, agent.life.drone, ev.kind_of(type(event)))
        agent.last = (subject, ev.encode(event), event.id)
        outboxes[c].append(agent.last)

    async def publish(c: int, subject: str, data: bytes, msg_id: str) -> None:
        try:
            await ncs[c].publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        except Exception:  # the client's buffer is full while it reconnects: an agent's spool
            counts["refused"] += 1

    def resender(c: int) -> Any:
        async def reconnected() -> None:
            counts["reconnects"] += 1
            now = dt.datetime.now(dt.UTC)
            for agent in groups[c]:
                if agent.last is None or agent.state is ev.DroneState.EXITING:
                    continue
                await publish(c, *agent.last)
                k = agent.life.newest(now.timestamp() - t0)
                agent.resent += 1
                seq = agent.life.events[k][1] + min(agent.resent, SEQ_STEP - 1)
                beat = agent.event(k, now, "heartbeat", seq)
                await publish(c, ns.event(SITE, agent.life.drone, "heartbeat"), ev.encode(beat), beat.id)
                counts["resent"] += 2

        return reconnected

    async def quiet(err: Exception) -> None:
        counts["errors"] += 1

    async def disconnected() -> None:
        counts["disconnects"] += 1

    for c in range(connections):
        nc = await nats.connect(
            url,
            max_reconnect_attempts=-1,
            reconnect_time_wait=2.0,
            pending_size=64 * 1024 * 1024,
            reconnected_cb=resender(c),
            error_cb=quiet,
            disconnected_cb=disconnected,
        )
        ncs.append(nc)
    due: list[tuple[float, int, int]] = [(a.life.events[0][0], i, 0) for i, a in enumerate(agents) if a.life.events]
    heapq.heapify(due)
    print(json.dumps({"ready": True}), flush=True)
    try:
        while due:
            at_rel = due[0][0]
            wait = t0 + at_rel - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            now = time.time()
            while due and t0 + due[0][0] <= now:
                at_rel, i, k = heapq.heappop(due)
                agent = agents[i]
                late.append(now - (t0 + at_rel))
                at = dt.datetime.fromtimestamp(t0 + at_rel, dt.UTC)
                send(i % connections, agent, agent.event(k, at))
                counts["published"] += 1
                if k + 1 < len(agent.life.events):
                    heapq.heappush(due, (agent.life.events[k + 1][0], i, k + 1))
            for c, out in enumerate(outboxes):
                outboxes[c] = []
                for message in out:
                    await publish(c, *message)
    finally:
        for nc in ncs:
            await nc.drain()
    return {**counts, "late": _common.percentiles(late)}


def main(argv: Sequence[str]) -> int:
    spec = json.loads(argv[0])
    params = Params(**spec["params"])
    report = asyncio.run(
        publish_plan(spec["url"], spec["prefix"], params, spec["t0"], spec["connections"])
    )
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["FACTS", "Params", "Plan", "asdict"]
