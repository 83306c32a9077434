"""
The spool's disk side: one thread writes, syncs and compacts the file, in the order of changes

Nothing here runs on the agent's event loop. The changes queued while the thread was busy
are written together with one ``write(2)`` and, if they add events, one ``fsync`` (group
commit); a waiter hears that its changes are on disk only after that ``fsync``. The thread
keeps its own copy of what the file holds, so it rewrites the file (compaction) without
asking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict, deque
from pathlib import Path
from typing import Final

import msgspec

log = logging.getLogger("remote_agent.spool")

MAGIC: Final = b"cobald-remote spool 1\n"
HEADER: Final = struct.Struct(">cII")
SEQ: Final = struct.Struct(">Q")
#: an emptied file is rewritten once it is larger than this: each rewrite costs two fsyncs,
#: which a slow scratch disk makes the gate wait for
_EMPTIED_BYTES = 64 * 1024
#: how long closing waits for the thread to write what is queued, in seconds
_CLOSE_WAIT_S = 30.0

#: the sync call, looked up at each use: tests put a slow disk here
fsync = os.fsync

#: one task waiting for a position of the queue to be on disk
_Waiter = tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]


class SpooledEvent(msgspec.Struct, frozen=True, array_like=True):
    """One encoded event waiting for its PubAck"""

    id: str  #: the dedupe id, sent as ``Nats-Msg-Id``
    seq: int
    kind: str
    subject: str
    data: bytes  #: the encoded event


_entry_encoder = msgspec.msgpack.Encoder()


def record(kind: bytes, payload: bytes) -> bytes:
    """One record of the file: ``<type:1><length:4><crc32:4><payload>``"""
    return HEADER.pack(kind, len(payload), zlib.crc32(payload)) + payload


def event_record(entry: SpooledEvent) -> bytes:
    return record(b"E", _entry_encoder.encode(entry))


def _size(entry: SpooledEvent) -> int:
    """About the bytes ``entry`` takes in the file"""
    return HEADER.size + 16 + len(entry.id) + len(entry.kind) + len(entry.subject) + len(entry.data)


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class DiskWriter:
    """
    The file of one spool and the thread that changes it; :meth:`start` it after opening

    :param path: the spool file
    :param compact_bytes: rewrite the file once it is this much larger than the events
        it holds
    """

    def __init__(self, path: Path, compact_bytes: int) -> None:
        self.path = path
        self.compact_bytes = compact_bytes
        #: whether writing failed, so the spool only holds events in memory
        self.degraded = False
        #: fsyncs of the file and of its directory, since the spool was opened
        self.syncs = 0
        self._fd: int | None = None
        self._on_disk: OrderedDict[str, SpooledEvent] = OrderedDict()
        self._last_seq: int | None = None
        self._file_bytes = 0
        self._live_bytes = 0
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, SpooledEvent | str]] = deque()
        self._queued = 0  #: position of the last change queued
        self._done = 0  #: position of the last change on disk
        self._waiters: list[_Waiter] = []
        self._stopping = False
        self._busy = False  #: the thread works on a batch or a rewrite
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the loop's side

    def rewrite(self, pending: list[SpooledEvent], last_seq: int | None) -> None:
        """
        Write ``pending`` as the whole file, synchronously: only before :meth:`start`

        :raises OSError: if the file cannot be written
        """
        self._on_disk = OrderedDict((e.id, e) for e in pending)
        self._last_seq = last_seq
        self._rewrite()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spool-writer", daemon=True)
        self._thread.start()

    def append(self, entry: SpooledEvent) -> None:
        """Queue ``entry`` to be written and synced"""
        self._put(entry)

    def remove(self, event_id: str) -> None:
        """Queue the note that ``event_id`` left the spool (written, not synced on its own)"""
        self._put(event_id)

    def _put(self, change: SpooledEvent | str) -> None:
        with self._cond:
            if self.degraded or self._stopping:
                return
            self._queued += 1
            self._queue.append((self._queued, change))
            self._cond.notify_all()

    async def synced(self) -> None:
        """Return once every change queued so far is on disk (or the disk failed)"""
        with self._cond:
            target = self._queued
            if self._done >= target or self.degraded or self._thread is None:
                return
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.append((target, loop, waiter))
        await waiter

    def flush(self) -> None:
        """Block until every change queued so far is on disk and the thread is idle"""
        with self._cond:
            target = self._queued
            self._cond.wait_for(
                lambda: (
                    (self._done >= target and not self._busy)
                    or self.degraded
                    or self._thread is None
                )
            )

    def close(self) -> None:
        """Write what is queued, stop the thread, close the file"""
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            thread.join(_CLOSE_WAIT_S)
            if thread.is_alive():
                log.error(
                    "spool %s: the disk did not take the last changes within %.0fs",
                    self.path,
                    _CLOSE_WAIT_S,
                )
                return
        self._close_fd()

    # ------------------------------------------------------------------ the thread's side

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                batch = list(self._queue)
                self._queue.clear()
                stop = self._stopping and not batch
                self._busy = not stop
            if stop:
                break
            try:
                if self._fd is not None and self._bloated():
                    # the batch goes into the new file: two fsyncs for both, not three
                    self._apply(batch)
                    self._rewrite()
                else:
                    self._commit(batch)
            except Exception as err:  # OSError, or anything: the agent goes on in memory
                self._degrade(err)
            self._finished(batch[-1][0])
            with self._cond:
                idle = not self._queue
            if idle and self._fd is not None and self._bloated():
                try:
                    self._rewrite()
                except Exception as err:
                    self._degrade(err)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        with self._cond:
            self._thread = None
            self._cond.notify_all()
        self._wake(self._take_waiters(None))

    def _commit(self, batch: list[tuple[int, SpooledEvent | str]]) -> None:
        """Append ``batch`` to the file; fsync it if it adds events"""
        if self._fd is None:
            return
        parts, events = self._apply(batch)
        view = memoryview(b"".join(parts))
        while view:
            view = view[os.write(self._fd, view) :]
        self._file_bytes += sum(len(p) for p in parts)
        if events:
            self._sync(self._fd)

    def _apply(self, batch: list[tuple[int, SpooledEvent | str]]) -> tuple[list[bytes], bool]:
        """Take ``batch`` into the copy of the file; its records, and whether it adds events"""
        parts: list[bytes] = []
        events = False
        for _, change in batch:
            if isinstance(change, str):
                entry = self._on_disk.pop(change, None)
                if entry is None:
                    continue
                self._live_bytes -= _size(entry)
                parts.append(record(b"X", change.encode()))
            else:
                events = True
                self._on_disk[change.id] = change
                self._live_bytes += _size(change)
                if self._last_seq is None or change.seq > self._last_seq:
                    self._last_seq = change.seq
                parts.append(event_record(change))
        return parts, events

    def _bloated(self) -> bool:
        emptied = not self._on_disk and self._file_bytes > _EMPTIED_BYTES
        return emptied or self._file_bytes > max(self.compact_bytes, 4 * self._live_bytes)

    def _sync(self, fd: int) -> None:
        fsync(fd)
        self.syncs += 1

    def _rewrite(self) -> None:
        """Write what the file should hold to a new file and put it in place of the old one"""
        self._close_fd()
        parts = [MAGIC]
        if self._last_seq is not None:
            parts.append(record(b"S", SEQ.pack(self._last_seq)))
        parts.extend(event_record(e) for e in self._on_disk.values())
        data = b"".join(parts)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            self._sync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            self._sync(dir_fd)
        finally:
            os.close(dir_fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._file_bytes = len(data)
        self._live_bytes = sum(_size(e) for e in self._on_disk.values())

    def _degrade(self, err: Exception) -> None:
        log.error(
            "spool %s cannot be written (%s): keeping events in memory only; they are "
            "lost if the agent dies before the broker has them",
            self.path,
            err,
        )
        with self._cond:
            self.degraded = True
            self._queue.clear()
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _finished(self, position: int) -> None:
        with self._cond:
            self._done = position
            self._cond.notify_all()
        self._wake(self._take_waiters(None if self.degraded else position))

    def _take_waiters(self, position: int | None) -> list[_Waiter]:
        """The waiters up to ``position`` (all of them for ``None``), no longer waiting"""
        ready: list[_Waiter] = []
        waiting: list[_Waiter] = []
        with self._cond:
            for waiter in self._waiters:
                (ready if position is None or waiter[0] <= position else waiting).append(waiter)
            self._waiters = waiting
        return ready

    @staticmethod
    def _wake(ready: list[_Waiter]) -> None:
        for _, loop, waiter in ready:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_release, waiter)
