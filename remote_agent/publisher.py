"""
The agent's single, ordered event publisher (``docs/agent.md``)

One task publishes the spool's events oldest first, each with ``Nats-Msg-Id`` set to its id,
and removes an event only after JetStream acknowledged it, over the agent's
:class:`~remote_agent.connection.Connection`, which retries forever.

Its rule for duplicates: the stream's dedupe window is the whole stream's, so anyone who
may publish to it can take an id first. A ``duplicate`` answer to an event this process
had sent before (a retry after a failure) means the stream has it; one to the first
attempt means another message holds its id, and the event is published again, in its
place in the order, under a fresh id (:func:`fresh_id`) that nobody can guess. An event
left in the spool by an earlier run of the agent counts as never sent: if that run had
stored it, the stream now holds it twice, which the manager takes in its stride.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import nats.js.errors

from remote_agent.connection import Connection
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import decode_event, encode
from remote_agent.protocol.names import MSG_ID
from remote_agent.protocol.ratelog import RateLimitedLog
from remote_agent.protocol.transient import Backoff, is_transient
from remote_agent.spool import Spool, SpooledEvent

log = logging.getLogger(__name__)
#: events published again under a fresh id: at most one line a minute
_taken = RateLimitedLog(log, interval_s=60.0)


def fresh_id(event_id: str) -> str:
    """``event_id`` made unique: followed by ``:`` and 16 random hex digits"""
    return f"{event_id}:{secrets.token_hex(8)}"


class Publisher(Connection):
    """
    The connection and the publishing task; run :meth:`run` as a task

    :param spool: the events to publish, oldest first
    :param servers: NATS URLs
    :param options: those of :class:`~remote_agent.connection.Connection`
    """

    def __init__(self, spool: Spool, servers: Sequence[str], **options: Any) -> None:
        super().__init__(servers, **options)
        self.spool = spool
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        #: events acknowledged (including duplicates), duplicates, events rejected for good
        self.published = 0
        self.duplicates = 0
        self.rejected = 0
        self.retries = 0
        #: events whose id another message held: published again under a fresh id
        self.taken = 0
        #: the spool's oldest event as this process publishes it (its id may be a fresh
        #: one), the spool's id of it, and whether this process sent it before
        self._current = SpooledEvent(id="", seq=0, kind="", subject="", data=b"")
        self._current_for: str | None = None
        self._sent = False

    def wake(self) -> None:
        """Tell the publishing task that the spool has a new event"""
        self._empty.clear()
        self._wake.set()

    def _on_connected(self) -> None:
        self._wake.set()

    def _backlog(self) -> int:
        return len(self.spool)

    async def run(self) -> None:
        """Connect, then publish the spool's events in order, forever"""
        await self._connect_retrying()
        backoff = Backoff(first=0.05, most=2.0)
        while True:
            entry = self.spool.peek()
            if entry is None:
                self._empty.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self.connected.is_set():
                await self.connected.wait()
            if await self._publish(entry):
                backoff.reset()
                continue
            # a transient failure: back off, but retry at once when the connection returns
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff.delay())

    async def _publish(self, entry: SpooledEvent) -> bool:
        """Publish one event; ``True`` if it left the spool"""
        assert self._js is not None
        if self._current_for != entry.id:
            self._current, self._current_for, self._sent = entry, entry.id, False
        while True:
            current = self._current
            try:
                ack = await self._js.publish(
                    current.subject,
                    current.data,
                    timeout=self.publish_timeout_s,
                    headers={MSG_ID: current.id},
                )
            except Exception as err:
                if is_transient(err):
                    # it may have been stored all the same: a duplicate is ours from now on
                    self._sent = True
                    self.retries += 1
                    log.debug(
                        "publishing %s seq %d failed, will retry: %r", entry.kind, entry.seq, err
                    )
                    return False
                if not isinstance(err, nats.js.errors.APIError):
                    raise
                # the stream refuses this event for good (too large, wrong subject): retrying
                # would block every later event behind it
                self.rejected += 1
                self._forget(entry)
                log.error(
                    "the stream rejected %s seq %d, dropping it: %s",
                    entry.kind,
                    entry.seq,
                    err,
                    extra={"event_id": current.id},
                )
                return True
            if not ack.duplicate:
                break
            if self._sent:
                # a resend within the stream's dedupe window: stored once (nats-server
                # server/stream.go, processJetStreamMsg)
                self.duplicates += 1
                log.debug("%s seq %d was stored already", entry.kind, entry.seq)
                break
            if not self._take_back(entry, ack.seq):
                return True
        self._forget(entry)
        self.published += 1
        return True

    def _take_back(self, entry: SpooledEvent, held_by: int) -> bool:
        """
        The stream holds another message under the id of ``entry``: give it a fresh id

        :returns: ``False`` if the spooled bytes are no event (then it is dropped)
        """
        self.taken += 1
        current = self._current
        try:
            event = decode_event(current.data, len(current.data))
        except SchemaError as err:
            self.rejected += 1
            self._forget(entry)
            log.error("spooled %s seq %d is no event, dropping it: %s", entry.kind, entry.seq, err)
            return False
        _taken.warning(
            "taken",
            "the stream holds another message (stream sequence %d) under the id of %s "
            "seq %d, which this agent never sent: publishing it under a fresh id "
            "(%d events so far)",
            held_by,
            entry.kind,
            entry.seq,
            self.taken,
            extra={"event_id": current.id},
        )
        renamed = msgspec.structs.replace(event, id=fresh_id(entry.id))
        self._current = msgspec.structs.replace(current, id=renamed.id, data=encode(renamed))
        return True

    def _forget(self, entry: SpooledEvent) -> None:
        self.spool.remove(entry.id)
        self._current_for, self._sent = None, False

    async def flush(self, timeout_s: float) -> bool:
        """
        Wait until every spooled event is acknowledged, at most ``timeout_s``

        :returns: whether the spool is empty
        """
        deadline = time.monotonic() + timeout_s
        while len(self.spool) and self.refused is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._empty.clear()
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), min(remaining, 0.1))
        return not len(self.spool)
