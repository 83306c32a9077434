"""What the demo reads from the bus after a run: handshake outcomes, one drone's timeline"""

from __future__ import annotations

from pathlib import Path

import nats
import nats.errors
import nats.js.errors

from broker.commands.timeline import format_timeline
from broker.emulation.groundtruth import read_ground_truth
from broker.manager.timeline import read_timeline
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import decode_record
from remote_agent.protocol.names import Namespace


async def record_outcomes(
    url: str, namespace: Namespace, creds: str | None = None
) -> dict[str, int]:
    """How each drone's handshake record ended: ``phase (writer)`` -> drones"""
    counts: dict[str, int] = {}
    nc = await connect(url, connect_timeout=2, allow_reconnect=False, user_credentials=creds)
    try:
        kv = await nc.jetstream().key_value(namespace.record_bucket)
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return counts
        for key in keys:
            entry = await kv.get(key)
            if entry.value is None:
                continue
            try:
                record = decode_record(entry.value)
            except SchemaError:
                continue
            label = f"{record.phase} ({record.writer})"
            counts[label] = counts.get(label, 0) + 1
    finally:
        await close(nc)
    return dict(sorted(counts.items()))


def interesting_drone(root: Path) -> str | None:
    """A drone TARDIS wanted to clean up while it was already running, else any with payloads"""
    started: dict[str, float] = {}
    for entry in read_ground_truth(root / "lbs.jsonl"):
        if entry["event"] == "job_started":
            started[entry["drone"]] = entry["t"]
    candidates: list[str] = []
    for entry in read_ground_truth(root / "tardis.jsonl"):
        drone = entry["drone"]
        if entry["state"] == "CleanupState" and drone in started and started[drone] < entry["t"]:
            candidates.append(drone)
    if candidates:
        return candidates[0]
    return next(iter(started), None)


async def sample_timeline(
    url: str, namespace: Namespace, drone: str, creds: str | None = None
) -> str:
    nc = await connect(url, connect_timeout=2, allow_reconnect=False, user_credentials=creds)
    try:
        rows = await read_timeline(nc, namespace, drone)
    finally:
        await close(nc)
    return format_timeline(rows)
