"""
What the metrics tests share: a registry holding a drone of every kind, and the samples of a
text as Prometheus reads them, or of a scrape of a running manager's endpoint
"""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from broker.manager.registry import Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace
from support.drones import FakeDrone

NS = Namespace()
SITE = "site1"


def parsed(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, labels), parsed the way Prometheus does"""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET /metrics`` of the manager serving on ``port`` (loopback), parsed (:func:`parsed`)"""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.split()[1] == b"200", head
    return parsed(body.decode())


def _apply(
    registry: Registry, drone: FakeDrone, event: ev.Event, at: float, stream_seq: int
) -> None:
    registry.apply_message(ev.encode(event), drone.subject(event, NS), at, stream_seq)


def fleet(registry: Registry, now: float) -> None:
    idle = FakeDrone(SITE, "site1-0000000001")
    busy = FakeDrone(SITE, "site1-0000000002")
    silent = FakeDrone(SITE, "site1-0000000003")
    for number, event in enumerate((idle.started(), idle.ready()), 1):
        _apply(registry, idle, event, now, number)
    started = busy.started()
    for number, event in enumerate((started, busy.ready(), busy.payload_started("7.0")), 3):
        _apply(registry, busy, event, now, number)
    _apply(registry, busy, started, now, 3)  # delivered again: stale
    beat = busy.heartbeat()
    _apply(registry, busy, beat, now, 6)
    _apply(registry, busy, beat, now, 6)  # delivered twice: duplicate
    _apply(registry, silent, silent.started(), now - 3600, 7)  # lost long ago
    registry.apply_message(b"\xc1", NS.event(SITE, "site1-0000000004", "heartbeat"), now)
    record = ev.DroneRecord(
        site=SITE,
        drone="site1-0000000005",
        phase=ev.RecordPhase.RELEASED,
        writer="manager",
        at=ev.utcnow(),
    )
    registry.apply_record(record, 3, now)
