"""
The drones of the flood benchmark: the honest ones, and the one flooding

An honest drone publishes what an agent publishes, each event awaiting its PubAck and
noted by its bytes for the manager's side to find; the flooder (run in a process of its
own) publishes as fast as its connection takes them, never waiting for an ack, either
valid events that flip its facts (each one wakes its TARDIS drone) or valid events of its
own mixed with invalid ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import time
from dataclasses import dataclass, field
from typing import Any

import _common
import msgspec
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
    #: encoded event -> (its index, time.monotonic() at publish)
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
        drone.pending[data] = (drone.published, time.monotonic())
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


def flip(drone: str, seq: int) -> ev.Event:
    """
    The flooder's valid event ``seq``: each changes a fact TARDIS's answers read

    In turn: a payload starts (busy), the gate closes, the payload ends (idle), the gate
    opens; every one a lifecycle step with the drone's whole snapshot, never a drain.
    """
    step = seq % 4
    running = [ev.Payload(job_id="1.0", slot="slot1_1", started_at=T0)] if step in (0, 1) else []
    if step == 0:
        message = event(ev.PayloadStarted, drone, seq, running, job_id="1.0")
    elif step == 1:
        message = event(ev.GateClosed, drone, seq, running)
    elif step == 2:
        message = event(
            ev.PayloadFinished, drone, seq, running, job_id="1.0", how=ev.PayloadEnd.EXIT
        )
    else:
        message = event(ev.GateOpened, drone, seq, running)
    if step in (1, 2):  # the gate is shut from its closing to its opening
        message = msgspec.structs.replace(
            message, snapshot=msgspec.structs.replace(message.snapshot, gate_open=False)
        )
    return message


#: what the flooder sends: only valid events that flip its facts, or the mix of valid and
#: invalid ones (:func:`flood_messages`)
FLOOD_MODES = ("flips", "mix")


async def flooder(url: str, creds: str, duration_s: float, mode: str) -> dict[str, Any]:
    """
    Publish for ``duration_s`` as fast as the connection takes it, never waiting for an ack

    :param mode: one of :data:`FLOOD_MODES`
    """

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
    seq, sent, valid = 10**15, 0, 0
    payloads = [ev.Payload(job_id=f"{i}.0", slot=f"slot1_{i}", started_at=T0) for i in range(8)]
    cpu, started = _common.cpu_seconds(), time.monotonic()
    deadline = started + duration_s
    while time.monotonic() < deadline:
        for _ in range(200):
            seq += 1
            if mode == "flips":
                message = flip(FLOODER, seq)
            else:
                kind = ev.Heartbeat if seq % 2 else ev.PayloadStarted
                fields: dict[str, object] = (
                    {"interval_s": 30.0} if kind is ev.Heartbeat else {"job_id": "1.0"}
                )
                message = event(kind, FLOODER, seq, payloads, **fields)
            subject = NS.event(SITE, FLOODER, ev.kind_of(type(message)))
            await nc.publish(subject, ev.encode(message), headers={"Nats-Msg-Id": message.id})
            sent += 1
            valid += 1
            if mode == "mix":
                subject, data, headers = invalid[seq % len(invalid)]
                await nc.publish(subject, data, headers=headers)
                sent += 1
    seconds = time.monotonic() - started
    with contextlib.suppress(Exception):
        await nc.flush(timeout=30)
    await nc.close()
    return {"sent": sent, "valid": valid, "seconds": seconds, "cpu_s": _common.cpu_seconds() - cpu}


async def announce(url: str, creds: str) -> None:
    """The flooder's first event, as an agent's: up and idle (its TARDIS drone comes up)"""
    nc = await connect(url, user_credentials=creds, inbox_prefix=f"_INBOX_{FLOODER}")
    try:
        message = flip(FLOODER, 10**15 - 1)  # the gate opens, idle
        subject = NS.event(SITE, FLOODER, ev.kind_of(type(message)))
        await nc.jetstream().publish(
            subject, ev.encode(message), headers={"Nats-Msg-Id": message.id}
        )
    finally:
        await nc.close()
