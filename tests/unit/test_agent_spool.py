"""The on-disk event spool: order, restart, full buffer, damaged files"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from remote_agent import spool_disk
from remote_agent.errors import SpoolError
from remote_agent.spool import FINAL_KINDS, MAGIC, Spool, SpooledEvent


def entry(seq: int, kind: str = "heartbeat") -> SpooledEvent:
    return SpooledEvent(
        id=f"d:inc:{seq}",
        seq=seq,
        kind=kind,
        subject=f"cobald.site1.d.evt.{kind}",
        data=b"\x81\xa4kind" + kind.encode() + bytes(seq % 7),
    )


def test_oldest_first_and_removal(tmp_path: Path) -> None:
    with Spool.open(tmp_path) as spool:
        for seq in range(1, 6):
            spool.append(entry(seq))
        assert [e.seq for e in spool] == [1, 2, 3, 4, 5]
        assert spool.peek() == entry(1)
        assert spool.remove("d:inc:1") and not spool.remove("d:inc:1")
        assert spool.remove("d:inc:3")
        assert [e.seq for e in spool] == [2, 4, 5]
        assert spool.last_seq == 5


def test_a_restart_finds_what_was_left_and_the_last_seq(tmp_path: Path) -> None:
    with Spool.open(tmp_path) as spool:
        for seq in range(10, 20):
            spool.append(entry(seq, "payload_started" if seq % 2 else "heartbeat"))
        spool.remove("d:inc:10")
    with Spool.open(tmp_path) as spool:
        assert [e.seq for e in spool] == list(range(11, 20))
        assert spool.peek() == entry(11, "payload_started")
        assert spool.last_seq == 19
        for e in list(spool):
            spool.remove(e.id)
    # once everything was acknowledged the file is compacted, yet the seq survives
    with Spool.open(tmp_path) as spool:
        assert len(spool) == 0 and spool.last_seq == 19
    assert (tmp_path / "events.spool").stat().st_size < 100


def test_a_full_spool_drops_heartbeats_first_then_the_oldest_non_final(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_events=4) as spool:
        spool.append(entry(1, "drained"))
        spool.append(entry(2, "payload_started"))
        spool.append(entry(3, "heartbeat"))
        spool.append(entry(4, "payload_finished"))
        assert spool.append(entry(5, "heartbeat")) == entry(3, "heartbeat")
        assert spool.append(entry(6, "gate_closed")) == entry(5, "heartbeat")
        assert spool.append(entry(7, "agent_exiting")) == entry(2, "payload_started")
        assert spool.append(entry(8, "heartbeat")) == entry(4, "payload_finished")
        assert [e.kind for e in spool] == ["drained", "gate_closed", "agent_exiting", "heartbeat"]
        assert spool.dropped == 4
        # the newest event is never the one dropped: its snapshot is the current truth
        assert spool.append(entry(9, "worker_exited")) == entry(8, "heartbeat")
        assert spool.peek() == entry(1, "drained")
    with Spool.open(tmp_path, max_events=4) as spool:
        assert [e.seq for e in spool] == [1, 6, 7, 9]


def test_when_only_final_events_remain_the_oldest_goes(tmp_path: Path) -> None:
    kinds = sorted(FINAL_KINDS)
    with Spool.open(tmp_path, max_events=3) as spool:
        for seq, kind in enumerate(kinds[:4], start=1):
            spool.append(entry(seq, kind))
        assert [e.seq for e in spool] == [2, 3, 4]


def test_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    with Spool.open(tmp_path) as spool:
        for seq in range(1, 4):
            spool.append(entry(seq))
    path = tmp_path / "events.spool"
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # the agent died in the middle of writing seq 3
    with Spool.open(tmp_path) as spool:
        assert [e.seq for e in spool] == [1, 2]
        assert spool.discarded_bytes > 0
        spool.append(entry(4))
    with Spool.open(tmp_path) as spool:
        assert [e.seq for e in spool] == [1, 2, 4]
        assert spool.discarded_bytes == 0


def test_a_damaged_record_ends_the_readable_part(tmp_path: Path) -> None:
    with Spool.open(tmp_path) as spool:
        for seq in range(1, 5):
            spool.append(entry(seq))
    path = tmp_path / "events.spool"
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # a flipped bit in the last record: its CRC no longer matches
    path.write_bytes(bytes(data))
    with Spool.open(tmp_path) as spool:
        assert [e.seq for e in spool] == [1, 2, 3]


def test_garbage_instead_of_a_spool_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / "events.spool").write_bytes(b"this is not a spool file\n" * 10)
    with Spool.open(tmp_path) as spool:
        assert len(spool) == 0 and spool.last_seq is None and spool.discarded_bytes == 250
        spool.append(entry(1))
    kept = list(tmp_path.glob("events.spool.unreadable-*"))
    assert len(kept) == 1
    assert (tmp_path / "events.spool").read_bytes().startswith(MAGIC)


def test_garbage_after_the_header(tmp_path: Path) -> None:
    (tmp_path / "events.spool").write_bytes(MAGIC + os.urandom(64))
    with Spool.open(tmp_path) as spool:
        assert len(spool) == 0 and spool.discarded_bytes == 64


def test_one_agent_per_spool(tmp_path: Path) -> None:
    with Spool.open(tmp_path), pytest.raises(SpoolError, match="in use by another agent"):
        Spool.open(tmp_path)
    Spool.open(tmp_path).close()  # released on close


def test_an_unusable_directory_is_a_spool_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpoolError, match="cannot use spool directory"):
        Spool.open(tmp_path / "file" / "spool")


def test_the_file_is_compacted_when_it_grows(tmp_path: Path) -> None:
    with Spool.open(tmp_path, compact_bytes=4096) as spool:
        for seq in range(1, 2000):
            spool.append(entry(seq))
            if seq > 3:
                spool.remove(f"d:inc:{seq - 3}")
        assert len(spool) == 3
        spool.flush()
        assert (tmp_path / "events.spool").stat().st_size < 4096 * 2
    with Spool.open(tmp_path) as spool:
        assert [e.seq for e in spool] == [1997, 1998, 1999]


def test_a_write_error_keeps_events_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    with Spool.open(tmp_path) as spool:
        spool.append(entry(1))
        spool.flush()
        monkeypatch.setattr(spool_disk, "fsync", broken)  # the disk went away under the agent
        spool.append(entry(2))
        spool.flush()
        assert spool.degraded and [e.seq for e in spool] == [1, 2]
        assert spool.remove("d:inc:1")
        spool.append(entry(3))
        assert [e.seq for e in spool] == [2, 3]
