"""
A bounded, ordered, crash-safe buffer of events on disk (``docs/agent.md``, "the spool")

An event leaves the spool only once JetStream acknowledged it. ``events.spool`` is
:data:`MAGIC`, then records ``<type:1><length:4><crc32:4><payload>`` (big-endian): ``E`` an
event (msgpack of :class:`SpooledEvent`), ``X`` the id of an event that left the spool,
``S`` the highest sequence number so far (8 bytes, written on compaction). Each record is
written whole; a torn or damaged tail fails its CRC and is cut off on opening. The
in-memory order changes at once; the file follows in a thread (:mod:`remote_agent.spool_disk`),
and :meth:`Spool.synced` waits until it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import msgspec

from remote_agent.errors import SpoolError
from remote_agent.private_dir import private_directory
from remote_agent.spool_disk import HEADER, MAGIC, SEQ, DiskWriter, SpooledEvent

__all__ = ["FINAL_KINDS", "MAGIC", "Spool", "SpooledEvent"]

log = logging.getLogger(__name__)

#: a record larger than this is corruption, not an event (events are <= 64 KiB)
_MAX_RECORD = 1 << 20

#: kinds a full spool drops last: the facts that end a drain or the drone
FINAL_KINDS: Final = frozenset(
    {
        "drain_accepted",
        "drain_deadline_expired",
        "drained",
        "released",
        "worker_exited",
        "agent_exiting",
    }
)


_entry_decoder = msgspec.msgpack.Decoder(SpooledEvent)


class Spool:
    """
    The ordered event buffer of one drone; open it with :meth:`open`

    Only one agent may use a spool directory at a time (an exclusive ``flock``
    on ``lock`` in it); a second one gets :class:`SpoolError`.

    :param directory: where ``events.spool`` and ``lock`` live
    :param max_events: capacity in events
    :param compact_bytes: rewrite the file once it is this much larger than
        the events it holds
    """

    def __init__(self, directory: Path, max_events: int = 10_000, compact_bytes: int = 1 << 20):
        if max_events < 2:
            raise ValueError("a spool must hold at least two events")
        self.directory = directory
        self.max_events = max_events
        self.compact_bytes = compact_bytes
        self.path = directory / "events.spool"
        self._pending: OrderedDict[str, SpooledEvent] = OrderedDict()
        self._last_seq: int | None = None
        self._lock_fd: int | None = None
        self._disk = DiskWriter(self.path, compact_bytes)
        #: events dropped because the spool was full, since it was opened
        self.dropped = 0
        #: bytes cut off a damaged file when it was opened
        self.discarded_bytes = 0

    # ------------------------------------------------------------------ open/close

    @classmethod
    def open(cls, directory: Path, max_events: int = 10_000, compact_bytes: int = 1 << 20) -> Spool:
        """
        Lock ``directory`` (created if missing) and load what a previous agent left

        :raises SpoolError: if the directory cannot be used or another agent holds it
        """
        spool = cls(directory, max_events, compact_bytes)
        spool._open()
        return spool

    @classmethod
    async def open_in_thread(cls, directory: Path, max_events: int = 10_000) -> Spool:
        """
        :meth:`open` in a thread, off the event loop; cancelled meanwhile, it still waits
        for the opening and closes that spool, so its lock is not left behind

        :raises SpoolError: as :meth:`open`
        """
        opening = asyncio.ensure_future(asyncio.to_thread(cls.open, directory, max_events))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            await asyncio.wait([opening])
            if not opening.cancelled() and opening.exception() is None:
                opening.result().close()
            raise

    def _open(self) -> None:
        try:
            private_directory(self.directory)
            self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise SpoolError(f"cannot use spool directory {str(self.directory)!r}: {err}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise SpoolError(
                f"spool {str(self.directory)!r} is in use by another agent of this drone"
            ) from None
        try:
            self._load()
            self._disk.rewrite(list(self._pending.values()), self._last_seq)
        except OSError as err:
            self.close()
            raise SpoolError(f"cannot write spool {str(self.path)!r}: {err}") from None
        self._disk.start()

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        if not data.startswith(MAGIC):
            kept = self.path.with_name(f"events.spool.unreadable-{int(time.time())}")
            os.replace(self.path, kept)
            self.discarded_bytes = len(data)
            log.error("spool %s is not a spool file; moved it to %s", self.path, kept)
            return
        offset = len(MAGIC)
        while offset < len(data):
            parsed = self._parse(data, offset)
            if parsed is None:
                self.discarded_bytes = len(data) - offset
                log.warning(
                    "spool %s: damaged record at byte %d, discarding the last %d bytes",
                    self.path,
                    offset,
                    self.discarded_bytes,
                )
                break
            kind, payload, offset = parsed
            self._apply(kind, payload)
        if self._pending:
            log.info(
                "spool %s: %d events left by an earlier agent, last seq %s",
                self.path,
                len(self._pending),
                self._last_seq,
            )

    @staticmethod
    def _parse(data: bytes, offset: int) -> tuple[bytes, bytes, int] | None:
        end = offset + HEADER.size
        if end > len(data):
            return None
        kind, length, crc = HEADER.unpack_from(data, offset)
        if kind not in (b"E", b"X", b"S") or length > _MAX_RECORD or end + length > len(data):
            return None
        payload = data[end : end + length]
        if zlib.crc32(payload) != crc:
            return None
        return kind, payload, end + length

    def _apply(self, kind: bytes, payload: bytes) -> None:
        if kind == b"E":
            try:
                entry = _entry_decoder.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError) as err:
                log.warning("spool %s: skipping an unreadable entry: %s", self.path, err)
                return
            self._pending[entry.id] = entry
            self._see_seq(entry.seq)
        elif kind == b"X":
            self._pending.pop(payload.decode(errors="replace"), None)
        else:
            self._see_seq(SEQ.unpack(payload)[0])

    def _see_seq(self, seq: int) -> None:
        if self._last_seq is None or seq > self._last_seq:
            self._last_seq = seq

    def close(self) -> None:
        """
        Write what is queued, close the file and release the lock; pending events stay on disk

        Blocks until the disk has the last changes: call it when the agent ends.
        """
        self._disk.close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ queries

    @property
    def degraded(self) -> bool:
        """Whether writing to disk failed, so the spool only holds events in memory"""
        return self._disk.degraded

    @property
    def syncs(self) -> int:
        """fsyncs of the file and its directory since the spool was opened"""
        return self._disk.syncs

    async def synced(self) -> None:
        """
        Return once every change so far is on disk: the events appended are written and
        fsynced (or the disk failed, which :attr:`degraded` tells and the log says)
        """
        await self._disk.synced()

    def flush(self) -> None:
        """:meth:`synced`, blocking: for tools and tests, never on the event loop"""
        self._disk.flush()

    @property
    def last_seq(self) -> int | None:
        """The highest sequence number the spool ever held (persisted), or ``None``"""
        return self._last_seq

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[SpooledEvent]:
        """The pending events, oldest first"""
        return iter(list(self._pending.values()))

    def peek(self) -> SpooledEvent | None:
        """The oldest pending event"""
        return next(iter(self._pending.values()), None)

    # ------------------------------------------------------------------ changes

    def append(self, entry: SpooledEvent) -> SpooledEvent | None:
        """
        Add ``entry`` as the newest event; it is on disk once :meth:`synced` returns

        :returns: the event dropped to make room, if the spool was full
        """
        self._pending[entry.id] = entry
        self._see_seq(entry.seq)
        self._disk.append(entry)
        if len(self._pending) <= self.max_events:
            return None
        victim = self._victim()
        self.remove(victim.id)
        self.dropped += 1
        log.warning(
            "spool full (%d events): dropped %s seq %d; the newer events' snapshots still "
            "tell the drone's state",
            self.max_events,
            victim.kind,
            victim.seq,
            extra={"dropped": self.dropped},
        )
        return victim

    def _victim(self) -> SpooledEvent:
        newest = next(reversed(self._pending))
        candidates = [e for e in self._pending.values() if e.id != newest]
        for entry in candidates:
            if entry.kind == "heartbeat":
                return entry
        for entry in candidates:
            if entry.kind not in FINAL_KINDS:
                return entry
        return candidates[0]

    def remove(self, event_id: str) -> bool:
        """
        Forget the event with ``event_id`` (it was acknowledged)

        :returns: whether it was still pending
        """
        entry = self._pending.pop(event_id, None)
        if entry is None:
            return False
        self._disk.remove(event_id)
        return True
