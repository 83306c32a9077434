"""
Registry memory per drone for the scale benchmark, against a dict of each drone's raw bytes

Counted with ``tracemalloc``: every byte the registry allocated and still holds after the
messages, divided by the drones; the messages are copied as the parser hands them over, so
the bytes the registry keeps count too.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import _common

from broker.manager.registry import Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace, dedupe_id

SITE = "bench"


def busy_heartbeats(n_drones: int, payloads: int = 8) -> list[tuple[str, bytes, str]]:
    """(subject, data, id): one heartbeat per drone, each drone running ``payloads`` payloads"""
    ns = Namespace("bench")
    at = ev.utcnow()
    out = []
    for i in range(n_drones):
        drone = _common.drone_name(SITE, i)
        running = [
            ev.Payload(job_id=f"{1_000_000 + i}.{k}", slot=f"slot1_{k + 1}", started_at=at)
            for k in range(payloads)
        ]
        snapshot = ev.Snapshot(
            state=ev.DroneState.BUSY, since=at, gate_open=True, slots=payloads,
            payloads=running, worker_pid=4711, started_at=at,
        )  # fmt: skip
        event_id = dedupe_id(drone, "inc0", 1)
        beat = ev.Heartbeat(
            site=SITE, drone=drone, incarnation="inc0", seq=1, at=at, id=event_id,
            snapshot=snapshot, interval_s=30.0,
        )  # fmt: skip
        out.append((ns.event(SITE, drone, "heartbeat"), ev.encode(beat), event_id))
    return out


def memory(messages: Sequence[tuple[str, bytes, str]], n_drones: int) -> dict[str, float]:
    """
    Bytes per drone held by the registry and by a dict of raw bytes (tracemalloc)

    Measured after the events, and again after one handshake record per drone
    (as a rebuilt registry holds them).
    """
    records = [(key, data) for key, data in record_values(n_drones)]
    now = time.time()
    gc.collect()
    tracemalloc.start()
    try:
        registry = Registry(Namespace("bench"))
        before = tracemalloc.get_traced_memory()[0]
        for subject, data, _ in messages:
            # a copy, as the parser hands each message over: the registry keeps the
            # bytes of each drone's newest event, and they must count here
            registry.apply_message(bytes(memoryview(data)), subject, now)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        assert len(registry) == n_drones, (len(registry), n_drones)
        for revision, (key, data) in enumerate(records, 1):
            registry.apply_record_message(key, data, revision, now)
        gc.collect()
        held_with_records = tracemalloc.get_traced_memory()[0] - before
        assert registry.records_applied == n_drones
        del registry
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        raw: dict[tuple[str, str], bytes] = {}
        for subject, data, _ in messages:
            parts = subject.split(".")
            raw[(parts[1], parts[2])] = bytes(memoryview(data))  # a copy, as off the wire
        raw_held = tracemalloc.get_traced_memory()[0] - before
        raw_bytes = sum(len(v) for v in raw.values())
        raw_records = {key: bytes(memoryview(data)) for key, data in records}
        raw_held_with_records = tracemalloc.get_traced_memory()[0] - before
        del raw, raw_records
    finally:
        tracemalloc.stop()
    return {
        "registry_bytes_per_drone": held / n_drones,
        "raw_dict_bytes_per_drone": raw_held / n_drones,
        "raw_msgpack_bytes_per_drone": raw_bytes / n_drones,
        "registry_with_record_bytes_per_drone": held_with_records / n_drones,
        "raw_dict_with_record_bytes_per_drone": raw_held_with_records / n_drones,
    }


def record_values(n_drones: int) -> list[tuple[str, bytes]]:
    """(key, value): one ``UP`` handshake record per drone, as a running fleet has"""
    ns = Namespace("bench")
    at = ev.utcnow()
    out = []
    for i in range(n_drones):
        drone = _common.drone_name(SITE, i)
        record = ev.DroneRecord(
            site=SITE, drone=drone, phase=ev.RecordPhase.UP, writer="agent",
            incarnation="0123456789ab", at=at,
        )  # fmt: skip
        out.append((ns.record_key(SITE, drone), ev.encode(record)))
    return out


def rss_bytes() -> int:
    fields = Path("/proc/self/statm").read_text().split()
    import os

    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
