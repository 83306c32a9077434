"""
The load both phases of the latency benchmark run under, the same in each

Events are published at a steady rate with ``publish_async`` and ``Nats-Msg-Id``, as agents
publish them, each send time noted by the event's id for whoever sees it arrive; core NATS
requests to an instant responder run beside them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from _common import Bus

from remote_agent.protocol import events as ev

#: the subject of the instant responder that core requests go to
RESPONDER = "bench.rr"


async def paced_load(
    bus: Bus,
    events: Sequence[ev.Event],
    rate: float,
    sent: dict[str, float],
    acked: list[float],
) -> float:
    """Publish ``events`` at ``rate`` per second; note send times by id; seconds taken"""
    js = bus.nc.jetstream(publish_async_max_pending=10_000)
    ns = bus.namespace
    encoded = [(ns.event(e.site, e.drone, ev.kind_of(type(e))), ev.encode(e), e.id) for e in events]
    start = time.perf_counter()
    clock = time.perf_counter
    for i, (subject, data, event_id) in enumerate(encoded):
        delay = start + i / rate - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        t = clock()
        sent[event_id] = t
        future = await js.publish_async(subject, data, headers={"Nats-Msg-Id": event_id})
        future.add_done_callback(functools.partial(_note_ack, acked, t))
    await asyncio.wait_for(js.publish_async_completed(), 30)
    return clock() - start


def _note_ack(acked: list[float], sent_at: float, _future: object) -> None:
    acked.append(time.perf_counter() - sent_at)


async def request_loop(bus: Bus, rtts: list[float], stop: asyncio.Event) -> None:
    """Core NATS requests to the instant responder, one after another, 100 per second"""
    while not stop.is_set():
        t = time.perf_counter()
        await bus.nc.request(RESPONDER, b"ping", timeout=2)
        rtts.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
