"""
A callback-driven pull loop on one JetStream consumer

Drives the pull API itself (``docs/architecture.md``, "Consuming the event stream"):
one callback on a private inbox, one or two pull requests outstanding, re-issued
after a reconnect and by a watchdog after silence. Its rule: every message it
hands to the handler is answered (ack, ``+TERM`` or ``-NAK``), a handler that
raises included (it is terminated); status messages never reach the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Mapping
from typing import Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker.errors import ConsumerGone
from broker.jetstream.fastpath import ACK_TAIL, NAK_TAIL, TERM_TAIL, Direct, parse_headers, route
from broker.jetstream.messages import ConsumerStats, Disposition, Handler, PullSettings
from broker.jetstream.rejections import given_up, handler_failed
from remote_agent.protocol.names import (
    DEFAULT_API_PREFIX,
    DESCRIPTION,
    MAX_DELIVERIES_ADVISORY,
    PENDING_MESSAGES,
    STATUS,
)
from remote_agent.protocol.transient import is_transient

log = logging.getLogger("cobald.runtime.cobald_remote.consumer")

_ACK: Final = b"+ACK"
_NAK: Final = b"-NAK"
_TERM: Final = b"+TERM"


class PullConsumer:
    """
    A callback-driven pull loop on one existing consumer

    :param nc: a connected client (with ``reconnected_cb`` calling :meth:`reconnected`)
    :param stream: the stream's name
    :param consumer: the consumer's name (durable or ephemeral)
    :param handler: applies one message and returns its :class:`Disposition`
    :param acks: whether the consumer wants acks (``False`` for ``AckPolicy.NONE``)
    :param headers: whether the handler needs the messages' headers (costs time)
    :param direct: take messages straight from the protocol parser (see
        :class:`Direct`) when the installed nats-py allows it
    :param stats: counters to add to (to keep counting across reconnects); a
        new :class:`ConsumerStats` by default
    """

    def __init__(
        self,
        nc: Client,
        stream: str,
        consumer: str,
        handler: Handler,
        *,
        acks: bool = True,
        headers: bool = False,
        settings: PullSettings | None = None,
        api: str = DEFAULT_API_PREFIX,
        direct: bool = True,
        stats: ConsumerStats | None = None,
    ) -> None:
        self.nc = nc
        self.stream = stream
        self.consumer = consumer
        self.handler = handler
        self.acks = acks
        self.headers = headers
        self.direct = direct
        self.settings = settings or PullSettings()
        self.stats = stats if stats is not None else ConsumerStats()
        self._next_subject = f"{api}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._info_api = f"{api}.CONSUMER.INFO.{stream}.{consumer}"
        self._request = self.settings.request()
        self._low_water = self.settings.batch // 2
        self._owed = 0
        self._inbox = ""
        self._sub: Subscription | None = None
        self._advisories: Subscription | None = None
        self._direct: Direct | None = None
        self._gone: ConsumerGone | None = None
        self._wake = asyncio.Event()
        self._activity = 0  # bumped by every message and control message

    @property
    def is_direct(self) -> bool:
        """Whether messages come straight from the protocol parser (the fast path)"""
        return self._direct is not None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Subscribe the private inbox and issue the first pull request"""
        if self._sub is not None:
            return
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(
            self._inbox,
            cb=self._on_message,
            pending_msgs_limit=-1,  # at most 1.5 batches are ever owed
            pending_bytes_limit=-1,
        )
        if self.direct:
            # route() logs why when the connection's nats-py does not allow it
            self._direct = route(self.nc, self._sub, self._on_raw)
            if self._direct is None:
                self.stats.direct_fallbacks += 1
        if self.acks:
            self._advisories = await self.nc.subscribe(
                f"{MAX_DELIVERIES_ADVISORY}.{self.stream}.{self.consumer}",
                cb=self._on_max_deliveries,
            )
        await self._pull()

    async def stop(self) -> None:
        """Stop asking for messages; messages owed to us are redelivered later"""
        sub, self._sub = self._sub, None
        advisories, self._advisories = self._advisories, None
        self._wake.set()
        if advisories is not None and not self.nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await advisories.unsubscribe()
        if sub is not None:
            if self._direct is not None:
                self._direct.unroute(sub)
            if not self.nc.is_closed:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    async def reconnected(self) -> None:
        """Re-issue the pull request after a reconnect (pull requests die with a connection)"""
        if self._sub is None:
            return
        log.info("re-issuing pull on %s/%s after reconnect", self.stream, self.consumer)
        self._owed = 0
        await self._pull()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """
        Consume until ``stop`` is set (or :meth:`stop` is called)

        :raises ConsumerGone: when the consumer no longer exists on the server
        """
        await self.start()
        stop = stop or asyncio.Event()
        period = self.settings.idle_heartbeat_s
        silent_checks = 0
        seen = self._activity
        try:
            while not stop.is_set() and self._sub is not None:
                if self._gone is not None:
                    raise self._gone
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(stop, self._wake), 2 * period)
                self._wake.clear()
                if self._gone is not None:
                    raise self._gone
                if self._activity != seen:
                    seen = self._activity
                    silent_checks = 0
                    continue
                if stop.is_set() or self._sub is None:
                    break
                # neither messages nor heartbeats for 2 x idle_heartbeat
                silent_checks += 1
                self.stats.watchdog += 1
                if silent_checks > self.settings.checks_before_lookup:
                    await self._check_exists()
                if self.nc.is_connected:
                    log.info(
                        "no messages or heartbeats on %s/%s for %.1fs, re-issuing the pull",
                        self.stream,
                        self.consumer,
                        2 * period,
                    )
                    self._owed = 0
                    await self._pull()
        finally:
            await self.stop()

    async def _check_exists(self) -> None:
        try:
            response = await self.nc.request(self._info_api, b"", timeout=2.0)
        except (nats.errors.Error, TimeoutError) as err:
            if is_transient(err):
                return  # no answer says nothing; try again later
            raise
        try:
            body = json.loads(response.data or b"{}")
        except ValueError:
            return
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("code") == 404:
            raise ConsumerGone(
                f"consumer {self.consumer!r} of stream {self.stream!r} does not exist any more"
            )

    # ------------------------------------------------------------ the hot path

    async def _pull(self) -> None:
        if self._sub is None or not self.nc.is_connected:
            return
        self._owed += self.settings.batch
        self.stats.requests += 1
        await self.nc.publish(self._next_subject, self._request, reply=self._inbox)

    def _on_raw(
        self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> Awaitable[None] | None:
        """
        One message straight from the parser (the fast path)

        The same steps as :meth:`_deliver`, written out once more because this
        runs for every message: a plain call instead of coroutines, and the
        ack collected directly (see :class:`Direct`). Returns the next pull
        request when one is due, for the parser to await.
        """
        self._activity += 1
        if headers is not None and not data and headers.startswith(b"NATS/1.0 "):
            parsed = parse_headers(headers)
            return self._on_status(parsed.get(STATUS, ""), parsed)
        if self._sub is None:
            return None  # stopped: leave it unacknowledged
        self._owed -= 1
        stats = self.stats
        stats.delivered += 1
        try:
            # a subject that is not UTF-8 (a drone may publish any bytes below its own
            # subjects) reaches the handler with replacement characters, to be rejected
            disposition = self.handler(
                subject.decode("utf-8", "replace"),
                reply.decode(),
                data,
                parse_headers(headers) if self.headers and headers else None,
            )
        except Exception as err:
            self._handler_error(subject, err)
            disposition = Disposition.TERM
        if self.acks:
            if disposition is Disposition.ACK:
                stats.acked += 1
                tail = ACK_TAIL
            elif disposition is Disposition.TERM:
                stats.termed += 1
                tail = TERM_TAIL
            else:
                stats.nacked += 1
                tail = NAK_TAIL
            direct = self._direct
            assert direct is not None
            direct.answer(reply, tail)
        return self._pull() if self._owed <= self._low_water else None

    async def _on_message(self, msg: Msg) -> None:
        """One message through nats-py's subscription callback (the portable path)"""
        self._activity += 1
        headers = msg.headers
        if headers is not None and not msg.data:
            status = headers.get(STATUS)
            if status is not None:
                await self._on_status(status, headers)
                return
        await self._deliver(msg.subject, msg.reply, msg.data, headers if self.headers else None)

    async def _deliver(
        self, subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> None:
        if self._sub is None:
            return  # stopped: leave it unacknowledged
        self._owed -= 1
        if self._owed <= self._low_water:
            await self._pull()
        stats = self.stats
        stats.delivered += 1
        try:
            disposition = self.handler(subject, reply, data, headers)
        except Exception as err:
            self._handler_error(subject, err)
            disposition = Disposition.TERM
        if not self.acks:
            return
        # Msg.ack() is exactly this publish (an empty body acks, too) plus a check
        # that the same Msg is not acked twice, which cannot happen here
        if disposition is Disposition.ACK:
            stats.acked += 1
            await self.nc.publish(reply, _ACK)
        elif disposition is Disposition.TERM:
            stats.termed += 1
            await self.nc.publish(reply, _TERM)
        else:
            stats.nacked += 1
            await self.nc.publish(reply, _NAK)

    def _handler_error(self, subject: str | bytes, err: Exception) -> None:
        handler_failed(self.stats, self.stream, self.consumer, self.acks, subject, err)

    async def _on_max_deliveries(self, msg: Msg) -> None:
        given_up(self.stats, self.stream, self.consumer, msg.data)

    async def _on_status(self, status: str, headers: Mapping[str, str]) -> None:
        stats = self.stats
        stats.statuses[status] = stats.statuses.get(status, 0) + 1
        if status == "100":
            stats.heartbeats += 1
            return
        if status not in ("404", "408", "409"):
            # 503 "no responders": the consumer is not there (deleted, or lost
            # with a restart), or JetStream is not up yet. Asking again at once
            # would spin; this is silence, and the watchdog takes it from here.
            self._activity -= 1
            self._owed = 0
            if stats.statuses[status] == 1 or stats.statuses[status] % 100 == 0:
                log.info(
                    "pull on %s/%s answered %s %s",
                    self.stream,
                    self.consumer,
                    status,
                    headers.get(DESCRIPTION, ""),
                )
            return
        # the request ended or was cut short: it owes no more than it says
        pending = headers.get(PENDING_MESSAGES)
        self._owed -= int(pending) if pending is not None else self.settings.batch
        self._owed = max(self._owed, 0)
        if status == "409":
            stats.cut_short += 1
            description = headers.get(DESCRIPTION, "")
            log.info("pull on %s/%s cut short: %s", self.stream, self.consumer, description)
            if "deleted" in description.lower():
                self._gone = ConsumerGone(
                    f"consumer {self.consumer!r} of stream {self.stream!r} was deleted"
                )
                self._wake.set()
                return
        else:
            stats.expired += 1
        if self._owed <= self._low_water:
            await self._pull()


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set"""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
