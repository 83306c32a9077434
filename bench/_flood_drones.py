"""
The drones of the flood benchmark: the honest ones, and the one flooding

An honest drone publishes what an agent publishes, each event awaiting its PubAck and
noted by its bytes for the manager's side to find; the flooder (run in a process of its
own) publishes valid events of its own and invalid ones as fast as its connection takes
them, never waiting for an ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import time
from dataclasses import dataclass, field

import _common
from nats.aio.client import Client

from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.names import Namespace, dedupe_id

SITE = "bench"
NS = Namespace()
FLOODER = _common.drone_name(SITE, 0xFFFFFF)
T0 = dt.datetime(2026, 3, 18, 12, 0, tzinfo=dt.UTC)


def event(
    kind: type[ev.Event], drone: str, seq: int, payloads: list[ev.Payload], **fields: object
) -> ev.Event:
    """An event as an agent makes it, with the drone's whole snapshot"""
    now = ev.utcnow()
    snapshot = ev.Snapshot(
        state=ev.DroneState.BUSY if payloads else ev.DroneState.IDLE,
        since=now,
        gate_open=True,
        slots=8,
        payloads=list(payloads),
        worker_pid=4711,
        started_at=T0,
    )
    head = {
        "site": SITE,
        "drone": drone,
        "incarnation": "inc0",
        "seq": seq,
        "at": now,
        "id": dedupe_id(drone, "inc0", seq),
        "snapshot": snapshot,
    }
    return kind(**head, **fields)  # type: ignore[arg-type]


@dataclass
class Honest:
    """One honest drone: its connection, its events in flight, the latencies seen"""

    name: str
    nc: Client
    seq: int
    rng: random.Random
    payloads: list[ev.Payload] = field(default_factory=list)
    #: encoded event -> (its index, perf_counter at publish)
    pending: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    published: int = 0
    seen: int = -1

    def next_event(self) -> ev.Event:
        self.seq += 1
        roll = self.rng.random()
        if roll < 0.1 and len(self.payloads) < 8:
            job = f"{self.seq}.0"
            self.payloads.append(ev.Payload(job_id=job, slot="slot1_1", started_at=ev.utcnow()))
            return event(ev.PayloadStarted, self.name, self.seq, self.payloads, job_id=job)
        if roll < 0.2 and self.payloads:
            job = self.payloads.pop(0).job_id
            return event(
                ev.PayloadFinished,
                self.name,
                self.seq,
                self.payloads,
                job_id=job,
                how=ev.PayloadEnd.EXIT,
                exit_code=0,
            )
        return event(ev.Heartbeat, self.name, self.seq, self.payloads, interval_s=30.0)


async def honest_loop(drone: Honest, interval_s: float, stop: asyncio.Event) -> None:
    js = drone.nc.jetstream(timeout=30)
    await asyncio.sleep(drone.rng.uniform(0, interval_s))
    while not stop.is_set():
        message = drone.next_event()
        data = ev.encode(message)
        drone.pending[data] = (drone.published, time.perf_counter())
        drone.published += 1
        subject = NS.event(SITE, drone.name, ev.kind_of(type(message)))
        with contextlib.suppress(Exception):  # a lost publish shows as a missing sample
            await js.publish(subject, data, headers={"Nats-Msg-Id": message.id})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s * drone.rng.uniform(0.8, 1.2))


# ------------------------------------------------------------------------ the flooder


def flood_messages(drone: str) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """A cycle of what the flooder sends: valid-looking events of its own, and invalid ones"""
    nested = b"\x81\xa5extra" + b"\x91" * 1000 + b"\xc0"  # an unknown field nested 1000 deep
    other = event(ev.Heartbeat, _common.drone_name(SITE, 1), 1, [], interval_s=30.0)
    root = NS.drone_root(SITE, drone)
    heartbeat, started = (
        NS.event(SITE, drone, "heartbeat"),
        NS.event(SITE, drone, "payload_started"),
    )
    return [
        (heartbeat, b"\xc1 garbage", None),
        (heartbeat, ev.encode(other), None),  # a body naming another drone
        (started, nested, None),
        (f"{root}.evt.made_up_kind", b"x", None),  # refused by the server
    ]


async def flooder(url: str, creds: str, duration_s: float) -> None:
    async def quiet(err: Exception) -> None:
        pass

    nc = await connect(
        url,
        user_credentials=creds,
        inbox_prefix=f"_INBOX_{FLOODER}",
        error_cb=quiet,
        pending_size=32 * 1024 * 1024,
    )
    invalid = flood_messages(FLOODER)
    seq, sent = 10**15, 0
    deadline = time.monotonic() + duration_s
    payloads = [ev.Payload(job_id=f"{i}.0", slot=f"slot1_{i}", started_at=T0) for i in range(8)]
    while time.monotonic() < deadline:
        for _ in range(200):
            seq += 1
            kind = ev.Heartbeat if seq % 2 else ev.PayloadStarted
            fields: dict[str, object] = (
                {"interval_s": 30.0} if kind is ev.Heartbeat else {"job_id": "1.0"}
            )
            valid = event(kind, FLOODER, seq, payloads, **fields)
            subject = NS.event(SITE, FLOODER, ev.kind_of(kind))
            await nc.publish(subject, ev.encode(valid), headers={"Nats-Msg-Id": valid.id})
            subject, data, headers = invalid[seq % len(invalid)]
            await nc.publish(subject, data, headers=headers)
            sent += 2
        with contextlib.suppress(Exception):
            await nc.flush(timeout=5)
    await nc.close()
    print(sent)
