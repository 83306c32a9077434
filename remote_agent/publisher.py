"""
The agent's single, ordered event publisher (``docs/agent.md``)

One task publishes the spool's events oldest first, each with ``Nats-Msg-Id`` set to its id,
and removes an event only after JetStream acknowledged it, over the agent's
:class:`~remote_agent.connection.Connection`, which retries forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors

from remote_agent.connection import Connection
from remote_agent.protocol.backoff import Backoff
from remote_agent.protocol.names import MSG_ID
from remote_agent.spool import Spool, SpooledEvent

log = logging.getLogger(__name__)

#: errors after which the same event is tried again (the broker is away or busy)
_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,  # no stream captures the subject (not provisioned)
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    asyncio.TimeoutError,
    OSError,
)


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
        try:
            ack = await self._js.publish(
                entry.subject,
                entry.data,
                timeout=self.publish_timeout_s,
                headers={MSG_ID: entry.id},
            )
        except _TRANSIENT as err:
            self.retries += 1
            log.debug("publishing %s seq %d failed, will retry: %r", entry.kind, entry.seq, err)
            return False
        except nats.js.errors.APIError as err:
            # the stream refuses this event for good (too large, wrong subject): retrying
            # would block every later event behind it
            self.rejected += 1
            self.spool.remove(entry.id)
            log.error(
                "the stream rejected %s seq %d, dropping it: %s",
                entry.kind,
                entry.seq,
                err,
                extra={"event_id": entry.id},
            )
            return True
        self.spool.remove(entry.id)
        self.published += 1
        if ack.duplicate:
            # a resend within the stream's dedupe window: stored once (nats-server
            # server/stream.go, processJetStreamMsg)
            self.duplicates += 1
            log.debug("%s seq %d was stored already", entry.kind, entry.seq)
        return True

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
