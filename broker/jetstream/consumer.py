"""
Fast pull consumption of a JetStream consumer

nats-py's ``PullSubscription.fetch()`` creates a task, a ``uuid4()`` and an
``asyncio.wait_for`` for every message and tops out near 25k msg/s. This
module drives the pull API itself (``docs/architecture.md``, "Consuming the
event stream"): it subscribes one callback on a private inbox and publishes
pull requests to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` with that
inbox as reply subject, keeping one or two requests outstanding.

* Messages with a ``Status`` header and no body are the server's control
  messages: ``100`` idle heartbeat, ``404``/``408`` a request ended (no
  messages, expired), ``409`` a request was cut short (consumer deleted,
  leadership change, a limit hit). They adjust the count of messages still
  owed and are never handed to the handler.
* Pull requests die with the connection: :meth:`PullConsumer.reconnected`
  (wire it to ``reconnected_cb``) re-issues them, and a watchdog re-issues
  when neither messages nor heartbeats arrived for twice the heartbeat
  interval (consumer leader changes, a lost request). After repeated silence
  it asks the server whether the consumer still exists; a deleted consumer
  ends :meth:`PullConsumer.run` with :class:`ConsumerGone`.
* Every other message goes to a **synchronous** handler, which applies it and
  returns what to tell the server: ack after apply, ``+TERM`` for a message
  that can never be applied, ``-NAK`` to have it redelivered. A handler that
  raises rejects that message: it is terminated (an ``AckPolicy.NONE``
  consumer skips it), counted in :attr:`ConsumerStats.handler_errors` and
  logged, rate-limited, with its subject and the exception's type, never its
  payload. No message can stop the loop or be left unacknowledged by it; only
  a process that dies before its acks are written leaves messages for
  redelivery, at most :data:`MAX_DELIVER` times (see :func:`durable_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import json
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Final

import nats.errors
import nats.js.errors
import nats.protocol.parser as nats_parser
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from broker.errors import BrokerError
from remote_agent.protocol.names import (
    DEFAULT_API_PREFIX,
    DESCRIPTION,
    MAX_DELIVERIES_ADVISORY,
    PENDING_MESSAGES,
    STATUS,
)
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
#: handler errors and given-up messages come in floods: one line per kind and interval
_rejections = RateLimitedLog(log)

#: pull batch of :func:`read_all`
READ_ALL_BATCH: Final = 2000
#: name of the manager's durable consumer on the event stream
DEFAULT_DURABLE: Final = "cobald-registry"
#: deliveries of one message to the durable before the server gives up on it
#: (see :func:`durable_config`)
MAX_DELIVER: Final = 5
#: exception types counted by name at most; more are counted as ``other``
_MAX_ERROR_KINDS: Final = 32

_ACK: Final = b"+ACK"
_NAK: Final = b"-NAK"
_TERM: Final = b"+TERM"


class ConsumerError(BrokerError):
    """A consumer could not be created, or exists with another configuration"""


class ConsumerGone(BrokerError):
    """The consumer was deleted on the server (or lost with a restart)"""


class Disposition(enum.Enum):
    """What a handler tells the server about one message"""

    ACK = "ack"  #: applied: never deliver it again
    TERM = "term"  #: can never be applied (invalid): never deliver it again
    NAK = "nak"  #: not applied now: deliver it again


#: a handler applies one message, ``(subject, reply, data, headers)``, and says
#: what to answer. It runs inside the connection's read loop, so it must not
#: block; ``headers`` is ``None`` unless the consumer was asked for them.
Handler = Callable[[str, str, bytes, "Mapping[str, str] | None"], Disposition]
#: what the parser hands over for one message: subject, reply, payload, raw headers;
#: returns what is left to await (rarely anything), so that the usual message
#: costs a plain call instead of a coroutine
_RawCallback = Callable[[bytes, bytes, bytes, "bytes | None"], "Awaitable[None] | None"]


@dataclass(frozen=True, slots=True)
class PullSettings:
    """
    How a :class:`PullConsumer` asks for messages

    :param batch: messages per pull request; another request is issued when
        fewer than half a batch are still owed, so at most two are outstanding.
        Large batches keep the server streaming, so that each read of the
        socket brings many messages: at 5,000 the manager applied about
        1.6 times as many events per second as at 500 (``bench/ingest.py
        --batch``); :func:`durable_config`'s ``max_ack_pending`` stays well
        above the 7,500 a consumer can be owed
    :param expires_s: lifetime of a pull request on the server
    :param idle_heartbeat_s: the server sends a heartbeat this often while a
        request waits; silence for twice as long makes the watchdog re-issue
    :param checks_before_lookup: watchdog re-issues without any answer before
        the consumer's existence is checked with the server
    """

    batch: int = 5000
    expires_s: float = 5.0
    idle_heartbeat_s: float = 2.5
    checks_before_lookup: int = 2

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, not {self.batch}")
        if not (0 < self.idle_heartbeat_s < self.expires_s):
            raise ValueError("need 0 < idle_heartbeat_s < expires_s")

    def request(self) -> bytes:
        return json.dumps(
            {
                "batch": self.batch,
                "expires": int(self.expires_s * 1e9),
                "idle_heartbeat": int(self.idle_heartbeat_s * 1e9),
            }
        ).encode()


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one :class:`PullConsumer` (read them, don't write them)"""

    delivered: int = 0  #: messages handed to the handler
    acked: int = 0
    termed: int = 0  #: terminated: the handler said so, or raised
    nacked: int = 0
    #: the handler raised: the message was terminated (skipped without acks)
    handler_errors: int = 0
    #: :attr:`handler_errors` by the exception's type name
    handler_error_types: dict[str, int] = field(default_factory=dict)
    #: messages the server gave up on after ``max_deliver`` deliveries (its advisory)
    max_deliveries: int = 0
    heartbeats: int = 0
    requests: int = 0  #: pull requests sent
    expired: int = 0  #: 404/408 answers
    cut_short: int = 0  #: 409 answers
    watchdog: int = 0  #: re-issues because of silence
    statuses: dict[str, int] = field(default_factory=dict)


def metadata(reply: str) -> tuple[int, int, float, int]:
    """
    ``(stream_seq, num_delivered, stored_time, num_pending)`` from a JetStream reply subject

    ``stored_time`` is when the stream stored the message, epoch seconds.
    Faster than nats-py's ``Msg.metadata`` (no datetime, no dataclass).

    :raises ValueError: if ``reply`` is not a JetStream ack subject
    """
    tokens = reply.split(".")
    n = len(tokens)
    if n == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<tm>.<pending>
        return int(tokens[5]), int(tokens[4]), int(tokens[7]) / 1e9, int(tokens[8])
    if n >= 11 and tokens[0] == "$JS" and tokens[1] == "ACK":  # with domain and account hash
        return int(tokens[7]), int(tokens[6]), int(tokens[9]) / 1e9, int(tokens[10])
    raise ValueError(f"not a JetStream reply subject: {reply!r}")


# ---------------------------------------------------------------------- provisioning


def durable_config(
    filter_subject: str,
    name: str = DEFAULT_DURABLE,
    *,
    ack_wait_s: float = 30.0,
    max_ack_pending: int = 20_000,
    max_deliver: int = MAX_DELIVER,
    replicas: int | None = None,
) -> ConsumerConfig:
    """
    The manager's durable pull consumer: explicit acks, starting with new messages

    It starts at the moment it is first created; everything older comes from
    the registry's rebuild, which also runs on every start. ``max_ack_pending``
    is well above two pull batches so that acks in flight never stall delivery:
    the pull loop answers every message it is handed (a handler that raises
    terminates it), so only the 1.5 batches a consumer can be owed are ever
    unacknowledged, whatever the messages contain.

    ``max_deliver`` bounds how often one message is delivered. A message goes
    out again only when no answer came within ``ack_wait``: the manager died
    or lost its connection before its acks were written. Five deliveries
    survive four such failures in a row within the same batch; a message that
    kills the manager every time (a crash, not an exception) stops after five
    restarts instead of circulating forever. A message given up on is not
    lost to the registry: the rebuild on the next start reads the stream
    itself, and each drone's next heartbeat carries its whole state.
    """
    return ConsumerConfig(
        durable_name=name,
        name=name,
        description="cobald-remote drone registry",
        deliver_policy=DeliverPolicy.NEW,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        max_deliver=max_deliver,
        filter_subject=filter_subject,
        num_replicas=replicas,
    )


#: fields whose difference from the wanted config is a conflict, not drift
_IDENTITY_FIELDS: Final = ("deliver_policy", "ack_policy", "filter_subject")


async def ensure_consumer(
    js: JetStreamContext, stream: str, config: ConsumerConfig
) -> ConsumerInfo:
    """
    Create the durable consumer, or confirm the existing one; safe to call on every start

    The server accepts a create with the same configuration as a no-op and
    updates the fields it may update in place (``ack_wait``, ``max_ack_pending``,
    ``max_deliver``, ...; a create without ``action`` is "create or update",
    nats-server server/consumer.go:180, 1122-1144, and the fields that can not
    change are listed in ``checkNewConsumerConfig``, consumer.go:2535-2601), so
    a durable provisioned by an older manager gets the current limits.

    :raises ConsumerError: if a consumer of that name exists with another
        delivery policy, ack policy or filter, or the server refuses it
    """
    name = config.durable_name or config.name or ""
    try:
        info = await js.consumer_info(stream, name)
    except nats.js.errors.NotFoundError:
        info = None
    except nats.js.errors.APIError as err:
        raise ConsumerError(f"cannot look up consumer {name!r} on {stream!r}: {err}") from err
    if info is not None:
        conflicts = [
            f"{field_name} is {getattr(info.config, field_name)!r}, "
            f"not {getattr(config, field_name)!r}"
            for field_name in _IDENTITY_FIELDS
            if getattr(info.config, field_name) != getattr(config, field_name)
        ]
        if conflicts:
            raise ConsumerError(
                f"consumer {name!r} on stream {stream!r} exists with another configuration "
                f"({'; '.join(conflicts)}): delete it (nats consumer rm {stream} {name}) "
                "or configure another consumer name"
            )
    try:
        return await js.add_consumer(stream, config)
    except nats.js.errors.APIError as err:
        raise ConsumerError(
            f"the server refused consumer {name!r} on stream {stream!r}: {err.description} "
            f"(code {err.code}, err_code {err.err_code})"
        ) from err


# ---------------------------------------------------------------------- direct dispatch


_H: Final = ord("H")


class _FastParser(nats_parser.Parser):
    """
    nats-py's protocol parser with a shorter way through ``MSG`` and ``HMSG``

    nats-py tries two regular expressions on every control line and keeps
    each message's arguments in a dict between two passes of its loop; for
    the small messages of the event stream that is about half of what
    receiving one costs (``bench/ingest.py``). This parser reads a message
    only once all of it is in the buffer, splits its control line at the
    spaces, and hands it to ``Client._process_msg`` exactly as nats-py does
    (``HMSG``: headers as bytes; ``MSG``: ``None``). Everything else (``PING``,
    ``PONG``, ``INFO``, ``+OK``, ``-ERR``, anything malformed) goes to
    nats-py's own :meth:`~nats.protocol.parser.Parser.parse`, and a message
    it began is finished here from its state.

    Installed by changing the class of a connection's parser (which keeps its
    buffer and state, and survives reconnects); see :meth:`_Direct.install`.
    """

    #: the routes of :class:`_Direct` on the same connection, by subscription id
    routes: dict[int, _RawCallback]

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        nc = self.nc
        routes = self.routes
        stats = nc.stats
        while buf:
            if self.state == nats_parser.AWAITING_MSG_PAYLOAD:
                # a message nats-py's parser began: finish it from its state
                needed = self.needed
                if len(buf) < needed + 2:
                    return
                begun = self.msg_arg
                header_needed = self.header_needed
                headers = bytes(buf[:header_needed]) if header_needed > 0 else None
                payload = bytes(buf[header_needed:needed])
                del buf[: needed + 2]
                self.header_needed = 0
                self.state = nats_parser.AWAITING_CONTROL_LINE
                await nc._process_msg(
                    begun["sid"], begun["subject"], begun["reply"], payload, headers
                )
            elif buf.startswith(b"HMSG ") or buf.startswith(b"MSG "):
                with_headers = buf[0] == _H
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > nats_parser.MAX_CONTROL_LINE_SIZE:
                        raise nats.errors.ProtocolError("nats: control line too long")
                    return
                # HMSG <subject> <sid> [reply] <header size> <total size>
                # MSG <subject> <sid> [reply] <size>
                args = bytes(buf[5 if with_headers else 4 : end]).split()
                try:
                    header_needed = int(args.pop(-2)) if with_headers else 0
                    if len(args) == 4:
                        subject, sid, reply, total_size = args
                    else:
                        subject, sid, total_size = args
                        reply = b""
                    needed = int(total_size)
                    start = end + 2
                    if len(buf) < start + needed + 2:
                        return  # the rest has not arrived; the line is read again then
                    sid_ = int(sid)
                except (ValueError, IndexError):
                    raise nats.errors.ProtocolError("nats: malformed MSG") from None
                headers = bytes(buf[start : start + header_needed]) if with_headers else None
                payload = bytes(buf[start + header_needed : start + needed])
                del buf[: start + needed + 2]
                route = routes.get(sid_)
                if route is None:
                    await nc._process_msg(sid_, subject, reply, payload, headers)
                else:  # what _Direct's wrapper of _process_msg does, without a coroutine
                    stats["in_msgs"] += 1
                    stats["in_bytes"] += len(payload)
                    rest = route(subject, reply, payload, headers)
                    if rest is not None:
                        await rest
            else:
                await super().parse()
                return
            if self.buf is not buf:
                return  # reset by a reconnect while the message was handled


class _Direct:
    """
    Direct dispatch on one client: chosen subscriptions straight from the parser

    nats-py turns every message into a ``Msg`` (parsing its headers with a
    Python loop), queues it, and wakes the subscription's task; for stream
    messages, which all carry ``Nats-Msg-Id``, that is half the cost of
    receiving one. The parser hands each message to ``Client._process_msg(sid,
    subject, reply, data, headers)``; wrapping that method on this client lets
    the pull loop take its own inbox's messages as raw bytes, in order, inside
    the read loop. Every other subscription keeps nats-py's normal path.

    Acks take the matching short cut: each is ``PUB <reply> 4\\r\\n+ACK``,
    collected while the parser works through what one read of the socket
    brought, then queued in one piece with ``Client._send_command``, and the
    flusher is kicked exactly as ``Client.publish`` does it, without
    re-validating and re-encoding subjects the server gave us. Every ack
    still follows its own message's handler; a connection lost before they
    are written leaves those messages unacknowledged, and the server
    redelivers them (which the registry treats as duplicates).

    This relies on private methods of nats-py, so :meth:`install` checks them:
    if the installed nats-py does not have them as expected it returns
    ``None`` and the pull loop uses a normal subscription callback instead.
    """

    _installed: ClassVar[weakref.WeakKeyDictionary[Client, _Direct]] = weakref.WeakKeyDictionary()

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.routes: dict[int, _RawCallback] = {}
        self._stats = nc.stats
        self._send_command = nc._send_command
        self._flush_pending = nc._flush_pending
        self._answers: list[bytes] = []
        self._writers: set[asyncio.Task[None]] = set()

    @classmethod
    def install(cls, nc: Client) -> _Direct | None:
        direct = cls._installed.get(nc)
        if direct is not None:
            return direct
        expected = {
            "_process_msg": ["sid", "subject", "reply", "data", "headers"],
            "_send_command": ["cmd", "priority"],
            "_flush_pending": ["force_flush"],
        }
        for name, parameters in expected.items():
            method = getattr(nc, name, None)
            if method is None or not inspect.iscoroutinefunction(method):
                return None
            try:
                if list(inspect.signature(method).parameters) != parameters:
                    return None
            except (TypeError, ValueError):
                return None
        if getattr(nc, "_flush_queue", None) is None:
            return None
        direct = cls(nc)
        parser = getattr(nc, "_ps", None)
        if type(parser) is nats_parser.Parser and all(
            hasattr(parser, name) for name in ("buf", "state", "needed", "header_needed", "msg_arg")
        ):
            parser.routes = direct.routes  # type: ignore[attr-defined]
            parser.__class__ = _FastParser
        original = nc._process_msg
        routes = direct.routes
        stats = direct._stats

        async def process_msg(
            sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            route = routes.get(sid)
            if route is None:
                await original(sid, subject, reply, data, headers)  # type: ignore[arg-type]
                return
            stats["in_msgs"] += 1
            stats["in_bytes"] += len(data)
            rest = route(subject, reply, data, headers)
            if rest is not None:
                await rest

        nc._process_msg = process_msg  # type: ignore[method-assign]
        cls._installed[nc] = direct
        return direct

    def answer(self, reply: bytes, command_tail: bytes) -> None:
        """
        Publish an ack (``command_tail`` = `` <size>\\r\\n<body>\\r\\n``) to ``reply``

        Collected, and written with the others of the same read of the
        socket once the parser is done with it (a task started by the first).
        """
        answers = self._answers
        answers.append(b"PUB " + reply + command_tail)
        if len(answers) == 1:
            writer = asyncio.get_running_loop().create_task(self._write_answers())
            self._writers.add(writer)  # the loop keeps weak references only
            writer.add_done_callback(self._writers.discard)

    async def _write_answers(self) -> None:
        answers, self._answers = self._answers, []
        nc = self.nc
        if not answers or nc.is_closed:
            return  # never acknowledged: the server redelivers them
        command = b"".join(answers)
        stats = self._stats
        stats["out_msgs"] += len(answers)
        # the bodies, without "PUB <reply> N\r\n" and "\r\n" around each
        stats["out_bytes"] += len(answers) * 4
        try:
            await self._send_command(command, False)
            queue = nc._flush_queue
            if queue is not None and queue.empty():
                await self._flush_pending(False)
        except Exception:  # a connection closing under us: nothing was acknowledged
            log.debug("acks not written: the connection is closing", exc_info=True)


_ACK_TAIL: Final = b" 4\r\n+ACK\r\n"
_NAK_TAIL: Final = b" 4\r\n-NAK\r\n"
_TERM_TAIL: Final = b" 5\r\n+TERM\r\n"


def _parse_headers(raw: bytes) -> dict[str, str]:
    """``NATS/1.0[ status[ description]]\\r\\nKey: value\\r\\n...`` as a dict"""
    lines = raw.split(b"\r\n")
    out: dict[str, str] = {}
    first = lines[0]
    if first.startswith(b"NATS/1.0 "):
        status, _, description = first[9:].partition(b" ")
        out[STATUS] = status.decode("ascii", "replace").strip()
        if description:
            out[DESCRIPTION] = description.decode("utf-8", "replace").strip()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.strip().decode("ascii", "replace")] = value.strip().decode("utf-8", "replace")
    return out


# ---------------------------------------------------------------------- the pull loop


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
        :class:`_Direct`) when the installed nats-py allows it
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
        self._direct: _Direct | None = None
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
        sid = getattr(self._sub, "_id", None)
        direct = _Direct.install(self.nc) if self.direct and isinstance(sid, int) else None
        if direct is not None:
            assert isinstance(sid, int)
            direct.routes[sid] = self._on_raw
            self._direct = direct
        elif self.direct:
            log.warning("this nats-py does not allow direct dispatch; using the slower Msg path")
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
                self._direct.routes.pop(getattr(sub, "_id", -1), None)
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
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return  # no answer says nothing; try again later
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
        ack collected directly (see :class:`_Direct`). Returns the next pull
        request when one is due, for the parser to await.
        """
        self._activity += 1
        if headers is not None and not data and headers.startswith(b"NATS/1.0 "):
            parsed = _parse_headers(headers)
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
                _parse_headers(headers) if self.headers and headers else None,
            )
        except Exception as err:
            self._handler_error(subject, err)
            disposition = Disposition.TERM
        if self.acks:
            if disposition is Disposition.ACK:
                stats.acked += 1
                tail = _ACK_TAIL
            elif disposition is Disposition.TERM:
                stats.termed += 1
                tail = _TERM_TAIL
            else:
                stats.nacked += 1
                tail = _NAK_TAIL
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
        """Count and log (rate-limited) a handler that raised: its subject and error type only"""
        stats = self.stats
        stats.handler_errors += 1
        kinds = stats.handler_error_types
        kind = type(err).__name__
        if kind not in kinds and len(kinds) >= _MAX_ERROR_KINDS:
            kind = "other"
        kinds[kind] = kinds.get(kind, 0) + 1
        if isinstance(subject, bytes):
            subject = subject.decode("utf-8", "replace")
        subject = subject[:256]
        _rejections.warning(
            f"handler {self.stream} {self.consumer} {kind}",
            "handler raised %s (at %s) on %s (stream %s, consumer %s): message %s",
            kind,
            _Origin(err),
            subject,
            self.stream,
            self.consumer,
            "terminated" if self.acks else "skipped",
            extra={"subject": subject},
        )

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """The server's advisory: a message reached ``max_deliver`` and is not delivered again"""
        self.stats.max_deliveries += 1
        try:
            body = json.loads(msg.data)
            seq, deliveries = int(body["stream_seq"]), int(body["deliveries"])
        except (ValueError, TypeError, KeyError):
            seq = deliveries = -1
        _rejections.warning(
            f"max_deliver {self.stream} {self.consumer}",
            "message %d of stream %s was delivered %d times to %s without an answer: "
            "the server gives up on it (max_deliver)",
            seq,
            self.stream,
            deliveries,
            self.consumer,
        )

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


class _Origin:
    """Where an exception was raised, ``file.py:line``, worked out only if a line is written"""

    __slots__ = ("err",)

    def __init__(self, err: BaseException) -> None:
        self.err = err

    def __str__(self) -> str:
        tb = self.err.__traceback__
        if tb is None:
            return "?"
        while tb.tb_next is not None:
            tb = tb.tb_next
        return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set"""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def read_all(
    nc: Client,
    js: JetStreamContext,
    stream: str,
    config: ConsumerConfig,
    handler: Callable[[str, str, bytes, Mapping[str, str] | None], object],
    *,
    headers: bool = False,
    settings: PullSettings | None = None,
    api: str = DEFAULT_API_PREFIX,
    timeout_s: float | None = None,
    stats: ConsumerStats | None = None,
) -> int:
    """
    Read every message an ephemeral ``AckPolicy.NONE`` consumer has at its creation

    Creates the consumer from ``config``, hands each message to ``handler``
    until as many as the consumer reported pending at creation were read,
    then deletes it. Messages stored later are read too if they arrive first;
    the caller must tolerate that (the registry does, by ``seq``). A message
    whose handler raises is read all the same: it is skipped, counted in
    ``stats.handler_errors`` and logged, and the reading goes on.

    :param stats: counters to add to (a new :class:`ConsumerStats` by default)
    :returns: the number of messages read, those whose handler raised included
    :raises ConsumerError: if the consumer cannot be created
    :raises TimeoutError: if the messages do not all arrive within ``timeout_s``
        (default: 120 s, plus a second for every 10,000 messages)
    """
    config = _ephemeral(config)
    try:
        info = await js.add_consumer(stream, config)
    except nats.js.errors.APIError as err:
        raise ConsumerError(f"cannot read {stream!r}: {err.description}") from err
    wanted = info.num_pending or 0
    if timeout_s is None:
        timeout_s = 120.0 + wanted / 10_000
    if wanted == 0:
        await _delete_quietly(js, stream, info.name)
        return 0
    done = asyncio.Event()
    count = 0

    def handle(
        subject: str, reply: str, data: bytes, msg_headers: Mapping[str, str] | None
    ) -> Disposition:
        nonlocal count
        count += 1  # before the handler: a message it raises on was read, too
        if count >= wanted:
            done.set()
        handler(subject, reply, data, msg_headers)
        return Disposition.ACK

    # AckNone and a known end: large batches save round trips
    settings = settings or PullSettings(batch=max(1, min(wanted, READ_ALL_BATCH)))
    pull = PullConsumer(
        nc,
        stream,
        info.name,
        handle,
        acks=False,
        headers=headers,
        settings=settings,
        api=api,
        stats=stats,
    )
    runner = asyncio.create_task(pull.run(done))
    try:
        await asyncio.wait_for(_first_done(done, runner), timeout_s)
        if runner.done() and not done.is_set():
            runner.result()  # raises what ended it
    except TimeoutError:
        raise TimeoutError(
            f"read {count} of {wanted} messages of {stream!r} in {timeout_s:.0f}s"
        ) from None
    finally:
        done.set()
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, BrokerError):
            await runner
        await _delete_quietly(js, stream, info.name)
    return count


async def _first_done(done: asyncio.Event, task: asyncio.Task[None]) -> None:
    waiter = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _ephemeral(config: ConsumerConfig) -> ConsumerConfig:
    return ConsumerConfig(
        description=config.description,
        deliver_policy=config.deliver_policy,
        opt_start_seq=config.opt_start_seq,
        opt_start_time=config.opt_start_time,
        ack_policy=AckPolicy.NONE,
        filter_subject=config.filter_subject,
        filter_subjects=config.filter_subjects,
        inactive_threshold=config.inactive_threshold or 60.0,
        mem_storage=True,
        num_replicas=1,
    )


async def _delete_quietly(js: JetStreamContext, stream: str, name: str) -> None:
    with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
        await js.delete_consumer(stream, name)
