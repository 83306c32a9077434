"""The spool on a disk whose fsync is slow: group commit, nothing on the loop, the gate waits"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
from support.waiting import wait_until

from remote_agent import spool_disk
from remote_agent.gate.client import ask
from remote_agent.gate.messages import GateDecisionReply, GateErrorReply, PrepareJobRequest
from remote_agent.gate.server import GateServer
from remote_agent.interfaces import GateDecision, JobStart
from remote_agent.protocol.events import PayloadEnd
from remote_agent.spool import Spool, SpooledEvent

SLOW_FSYNC_S = 0.4


def entry(seq: int) -> SpooledEvent:
    return SpooledEvent(id=f"d:inc:{seq}", seq=seq, kind="heartbeat", subject="s", data=bytes(200))


class SlowDisk:
    """``fsync`` that takes :data:`SLOW_FSYNC_S`; when each one ended"""

    def __init__(self) -> None:
        self.ended: list[float] = []
        self.threads: set[int] = set()

    def __call__(self, fd: int) -> None:
        self.threads.add(threading.get_ident())
        time.sleep(SLOW_FSYNC_S)
        os.fsync(fd)
        self.ended.append(time.monotonic())


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> SlowDisk:
    disk = SlowDisk()
    monkeypatch.setattr(spool_disk, "fsync", disk)
    return disk


@pytest.mark.timeout(30)
async def test_appends_share_an_fsync_and_synced_waits_for_it(
    tmp_path: Path, slow: SlowDisk
) -> None:
    spool = await asyncio.to_thread(Spool.open, tmp_path)
    try:
        opened = len(slow.ended)
        for seq in range(1, 51):
            spool.append(entry(seq))
            await asyncio.sleep(0.01)
        appended = time.monotonic()
        await spool.synced()
        assert slow.ended[-1] > appended  # the last append's fsync ended before synced did
        assert len(slow.ended) - opened < 10  # 50 events, a handful of fsyncs
        assert threading.get_ident() not in slow.threads  # never on the loop's thread
    finally:
        await asyncio.to_thread(spool.close)
    with Spool.open(tmp_path) as again:
        assert [e.seq for e in again] == list(range(1, 51))


@pytest.mark.timeout(30)
async def test_compaction_runs_in_the_thread(tmp_path: Path, slow: SlowDisk) -> None:
    spool = await asyncio.to_thread(Spool.open, tmp_path)
    try:
        for seq in range(1, 401):
            spool.append(entry(seq))
        for seq in range(1, 401):
            spool.remove(f"d:inc:{seq}")  # emptied, file over the threshold: rewritten
        await asyncio.to_thread(spool.flush)
        # the rewrite's fsyncs ran, none on the loop's thread
        assert slow.threads and threading.get_ident() not in slow.threads
    finally:
        await asyncio.to_thread(spool.close)
    assert (tmp_path / "events.spool").stat().st_size < 100
    with Spool.open(tmp_path) as again:
        assert len(again) == 0 and again.last_seq == 400


class SlowRecords:
    """A gate handler that allows everything; its records reach the disk when told to"""

    def __init__(self) -> None:
        self.on_disk = asyncio.Event()

    def prepare_job(self, job: JobStart) -> GateDecision:
        return GateDecision(allow=True)

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        return None

    async def settled(self) -> None:
        await self.on_disk.wait()


async def test_the_gate_says_yes_only_once_the_record_is_on_disk(tmp_path: Path) -> None:
    handler = SlowRecords()
    server = GateServer(tmp_path / "g" / "gate.sock", handler, request_timeout_s=0.5)
    await server.start()
    try:
        asked = asyncio.ensure_future(
            asyncio.to_thread(ask, server.path, PrepareJobRequest(job_id="1.0"), 10.0)
        )
        reply = await asked
        assert isinstance(reply, GateErrorReply)  # never on disk: no yes
        assert server.counts["not_settled"] == 1
        asked = asyncio.ensure_future(
            asyncio.to_thread(ask, server.path, PrepareJobRequest(job_id="2.0"), 10.0)
        )
        await asyncio.sleep(0.2)
        assert not asked.done()
        handler.on_disk.set()
        assert await asked == GateDecisionReply(allow=True)
    finally:
        await server.close()


@pytest.mark.timeout(30)
async def test_a_cancelled_open_leaves_no_lock_behind(tmp_path: Path, slow: SlowDisk) -> None:
    opening = asyncio.ensure_future(Spool.open_in_thread(tmp_path))
    await wait_until(lambda: bool(slow.threads), what="the thread's first fsync")
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    spool = await Spool.open_in_thread(tmp_path)  # the lock is free again
    await asyncio.to_thread(spool.close)
