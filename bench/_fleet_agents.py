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
from collections.abc import Awaitable, Callable, Sequence
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
FACTS = (
    "gate_opened",
    "payload_started",
    "payload_finished",
    "draining",
    "drained",
    "agent_exiting",
)
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
            1
            for life in self.lives.values()
            for at, _, kind, _ in life.events
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
        """The ``k``-th planned event (or a ``kind`` of event with ``seq`` in its stead)"""
        _, planned_seq, planned_kind, _ = self.life.events[k]
        kind = kind or planned_kind
        seq = seq or planned_seq
        job = f"{self.life.drone}.{planned_seq}"
        if kind == "payload_started":
            self.payloads.append(
                ev.Payload(job_id=job, slot=f"slot1_{len(self.payloads) + 1}", started_at=at)
            )
        elif kind == "payload_finished" and self.payloads:
            job = self.payloads.pop(0).job_id
        state = _state(kind, len(self.payloads), at.timestamp() - self.t0 >= self.life.draining)
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
        return _BUILD[kind](head, job, len(self.payloads))


#: each kind's event from its head, the payload's job id and the payloads running
_BUILD: dict[str, Callable[[dict[str, Any], str, int], ev.Event]] = {
    "heartbeat": lambda head, job, n: ev.Heartbeat(**head, interval_s=HEARTBEAT_S),
    "payload_started": lambda head, job, n: ev.PayloadStarted(**head, job_id=job, slot="slot1_1"),
    "payload_finished": lambda head, job, n: ev.PayloadFinished(
        **head, job_id=job, how=ev.PayloadEnd.EXIT, exit_code=0
    ),
    "agent_started": lambda head, job, n: ev.AgentStarted(**head, agent_version="bench", pid=4711),
    "worker_started": lambda head, job, n: ev.WorkerStarted(**head, pid=4711, command=["sleep"]),
    "startd_ready": lambda head, job, n: ev.StartdReady(**head, slots=SLOTS),
    "gate_opened": lambda head, job, n: ev.GateOpened(**head),
    "draining": lambda head, job, n: ev.Draining(
        **head, payloads=n, deadline=head["at"] + dt.timedelta(minutes=10)
    ),
    "drained": lambda head, job, n: ev.Drained(**head),
    "agent_exiting": lambda head, job, n: ev.AgentExiting(**head, exit_code=0),
}


class Publisher:
    """
    The agents' connections: each publishes its drones' events when due, and after a
    reconnect each of its drones sends its newest event again and a heartbeat
    """

    def __init__(self, plan: Plan, prefix: str, t0: float, connections: int) -> None:
        self.ns = Namespace(prefix)
        self.t0 = t0
        self.agents = [Agent(life, t0) for life in plan.lives.values()]
        self.connections = connections
        self.ncs: list[Any] = []
        self.outboxes: list[list[tuple[str, bytes, str]]] = [[] for _ in range(connections)]
        self.counts = dict.fromkeys(
            ("published", "resent", "reconnects", "refused", "errors", "disconnects"), 0
        )
        self.late: list[float] = []

    async def connect(self, url: str) -> None:
        async def error(err: Exception) -> None:
            self.counts["errors"] += 1

        async def disconnected() -> None:
            self.counts["disconnects"] += 1

        for c in range(self.connections):
            self.ncs.append(
                await nats.connect(
                    url,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=2.0,  # the agent's own reconnect_wait_s
                    pending_size=64 * 1024 * 1024,
                    reconnected_cb=self._resender(c),
                    error_cb=error,
                    disconnected_cb=disconnected,
                )
            )

    async def _publish(self, c: int, subject: str, data: bytes, msg_id: str) -> None:
        try:
            await self.ncs[c].publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        except Exception:  # the client's buffer is full while it reconnects
            self.counts["refused"] += 1

    def _resender(self, c: int) -> Callable[[], Awaitable[None]]:
        async def reconnected() -> None:
            self.counts["reconnects"] += 1
            now = dt.datetime.now(dt.UTC)
            for agent in self.agents[c :: self.connections]:
                if agent.last is None or agent.state is ev.DroneState.EXITING:
                    continue
                await self._publish(c, *agent.last)
                k = agent.life.newest(now.timestamp() - self.t0)
                agent.resent += 1
                seq = agent.life.events[k][1] + min(agent.resent, SEQ_STEP - 1)
                beat = agent.event(k, now, "heartbeat", seq)
                subject = self.ns.event(SITE, agent.life.drone, "heartbeat")
                await self._publish(c, subject, ev.encode(beat), beat.id)
                self.counts["resent"] += 2

        return reconnected

    async def run(self) -> None:
        """Publish every planned event when it is due"""
        agents, t0 = self.agents, self.t0
        due = [(a.life.events[0][0], i, 0) for i, a in enumerate(agents) if a.life.events]
        heapq.heapify(due)
        while due:
            await asyncio.sleep(max(0.0, t0 + due[0][0] - time.time()))
            now = time.time()
            while due and t0 + due[0][0] <= now:
                at_rel, i, k = heapq.heappop(due)
                agent = agents[i]
                self.late.append(now - (t0 + at_rel))
                event = agent.event(k, dt.datetime.fromtimestamp(t0 + at_rel, dt.UTC))
                subject = self.ns.event(SITE, agent.life.drone, ev.kind_of(type(event)))
                agent.last = (subject, ev.encode(event), event.id)
                self.outboxes[i % self.connections].append(agent.last)
                self.counts["published"] += 1
                if k + 1 < len(agent.life.events):
                    heapq.heappush(due, (agent.life.events[k + 1][0], i, k + 1))
            for c, out in enumerate(self.outboxes):
                self.outboxes[c] = []
                for message in out:
                    await self._publish(c, *message)

    async def close(self) -> dict[str, Any]:
        for nc in self.ncs:
            await nc.drain()
        return {**self.counts, "late": _common.percentiles(self.late)}


async def publish_plan(
    url: str, prefix: str, params: Params, t0: float, connections: int
) -> dict[str, Any]:
    """Publish every planned event when it is due; resend after each reconnect"""
    publisher = Publisher(Plan(params), prefix, t0, connections)
    await publisher.connect(url)
    print(json.dumps({"ready": True}), flush=True)
    try:
        await publisher.run()
    finally:
        report = await publisher.close()
    return report


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
