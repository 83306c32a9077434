"""
Direct dispatch: messages of chosen subscriptions straight from nats-py's protocol parser

The only module that touches nats-py's private attributes. Each connection is checked
(:func:`self_check`) before its first pull: where its nats-py is not what this module
was written against, the connection takes nats-py's normal path, loudly (a WARNING
line, ``ConsumerStats.direct_fallbacks``). Written and tested against the nats-py
releases in :data:`TESTED_NATS_PY`, which the ``test`` extra pins;
``tests/unit/test_fast_parser.py`` fails on any other.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import ClassVar, Final

import nats.errors
import nats.protocol.parser as nats_parser
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from remote_agent.protocol.names import DESCRIPTION, STATUS

log = logging.getLogger("cobald.runtime.cobald_remote.consumer")

#: what the parser hands over for one message: subject, reply, payload, raw headers;
#: returns what is left to await (rarely anything), so that the usual message
#: costs a plain call instead of a coroutine
RawCallback = Callable[[bytes, bytes, bytes, "bytes | None"], "Awaitable[None] | None"]

_H: Final = ord("H")

#: the nats-py releases this module's use of nats-py's internals was tested against
TESTED_NATS_PY: Final = ("2.16.0",)

#: the private methods of ``Client`` it calls or replaces, with their parameters
_METHODS: Final = {
    "_process_msg": ["sid", "subject", "reply", "data", "headers"],
    "_send_command": ["cmd", "priority"],
    "_flush_pending": ["force_flush"],
}
#: what it reads and sets of nats-py's parser, its module, and the client's counters
_PARSER_STATE: Final = ("buf", "state", "needed", "header_needed", "msg_arg", "nc")
_PARSER_NAMES: Final = ("AWAITING_CONTROL_LINE", "AWAITING_MSG_PAYLOAD", "MAX_CONTROL_LINE_SIZE")
_STATS: Final = ("in_msgs", "in_bytes", "out_msgs", "out_bytes")


def nats_py_version() -> str:
    """The installed nats-py's version, or ``"unknown"``"""
    try:
        return metadata.version("nats-py")
    except metadata.PackageNotFoundError:
        return "unknown"


def self_check(nc: Client) -> str | None:
    """
    What of ``nc``'s nats-py internals is not as direct dispatch expects; ``None``: all is

    Checks every private method it calls (a coroutine function with exactly these
    parameters), the flush queue, the parser (nats-py's own class, with the state
    :class:`FastParser` takes over), the parser module's states and the client's
    counters.
    """
    for name, parameters in _METHODS.items():
        method = getattr(nc, name, None)
        if method is None or not inspect.iscoroutinefunction(method):
            return f"Client.{name} is not a coroutine method"
        try:
            found = list(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            found = []
        if found != parameters:
            return f"Client.{name} takes ({', '.join(found)}), not ({', '.join(parameters)})"
    if getattr(nc, "_flush_queue", None) is None:
        return "Client._flush_queue is missing"
    parser = getattr(nc, "_ps", None)
    if type(parser) is not nats_parser.Parser:
        return f"the client's parser is a {type(parser).__qualname__}, not nats-py's Parser"
    missing = [name for name in _PARSER_STATE if not hasattr(parser, name)]
    missing += [name for name in _PARSER_NAMES if not hasattr(nats_parser, name)]
    if missing:
        return f"nats-py's parser lacks {', '.join(missing)}"
    stats = getattr(nc, "stats", None)
    if not isinstance(stats, dict) or not all(key in stats for key in _STATS):
        return "Client.stats lacks the message counters"
    return None


def _msg_args(line: bytes, with_headers: bool) -> tuple[bytes, int, bytes, int, int]:
    """
    ``(subject, sid, reply, header size, total size)`` of a control line after its verb

    ``HMSG <subject> <sid> [reply] <header size> <total size>``,
    ``MSG <subject> <sid> [reply] <size>``.
    """
    args = line.split()
    try:
        header_needed = int(args.pop(-2)) if with_headers else 0
        if len(args) == 4:
            subject, sid, reply, total_size = args
        else:
            subject, sid, total_size = args
            reply = b""
        return subject, int(sid), reply, header_needed, int(total_size)
    except (ValueError, IndexError):
        raise nats.errors.ProtocolError("nats: malformed MSG") from None


class FastParser(nats_parser.Parser):
    """
    nats-py's protocol parser with a shorter way through ``MSG`` and ``HMSG``

    nats-py tries two regular expressions on every control line and keeps
    each message's arguments in a dict between two passes of its loop, a large
    part of receiving the event stream's small messages (``bench/ingest.py``
    measures it). This parser reads a message
    only once all of it is in the buffer, splits its control line at the
    spaces, and hands it to ``Client._process_msg`` exactly as nats-py does
    (``HMSG``: headers as bytes; ``MSG``: ``None``). Everything else (``PING``,
    ``PONG``, ``INFO``, ``+OK``, ``-ERR``, anything malformed) goes to
    nats-py's own :meth:`~nats.protocol.parser.Parser.parse`, and a message
    it began is finished here from its state.

    Installed by changing the class of a connection's parser (which keeps its
    buffer and state, and survives reconnects); see :meth:`Direct.install`.
    """

    #: the routes of :class:`Direct` on the same connection, by subscription id
    routes: dict[int, RawCallback]

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        nc = self.nc
        routes = self.routes
        stats = nc.stats
        while buf:
            if self.state == nats_parser.AWAITING_MSG_PAYLOAD:
                if not await self._finish_begun():
                    return
            elif buf.startswith(b"HMSG ") or buf.startswith(b"MSG "):
                with_headers = buf[0] == _H
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > nats_parser.MAX_CONTROL_LINE_SIZE:
                        raise nats.errors.ProtocolError("nats: control line too long")
                    return
                subject, sid_, reply, header_needed, needed = _msg_args(
                    bytes(buf[5 if with_headers else 4 : end]), with_headers
                )
                start = end + 2
                if len(buf) < start + needed + 2:
                    return  # the rest has not arrived; the line is read again then
                headers = bytes(buf[start : start + header_needed]) if with_headers else None
                payload = bytes(buf[start + header_needed : start + needed])
                del buf[: start + needed + 2]
                route = routes.get(sid_)
                if route is None:
                    await nc._process_msg(sid_, subject, reply, payload, headers)
                else:  # what Direct's wrapper of _process_msg does, without a coroutine
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

    async def _finish_begun(self) -> bool:
        """Finish a message nats-py's parser began, from its state; whether it was all there"""
        buf = self.buf
        needed = self.needed
        if len(buf) < needed + 2:
            return False
        begun = self.msg_arg
        header_needed = self.header_needed
        headers = bytes(buf[:header_needed]) if header_needed > 0 else None
        payload = bytes(buf[header_needed:needed])
        del buf[: needed + 2]
        self.header_needed = 0
        self.state = nats_parser.AWAITING_CONTROL_LINE
        await self.nc._process_msg(begun["sid"], begun["subject"], begun["reply"], payload, headers)
        return True


class Direct:
    """
    Direct dispatch on one client: chosen subscriptions straight from the parser

    nats-py turns every message into a ``Msg`` (parsing its headers with a
    Python loop), queues it, and wakes the subscription's task; for stream
    messages, which all carry ``Nats-Msg-Id``, that is much of the cost of
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

    This relies on private methods of nats-py, so :meth:`install` checks them
    (:func:`self_check`): if the installed nats-py does not have them as expected
    it says so in a WARNING line and returns ``None``, and the pull loop uses a
    normal subscription callback instead.
    """

    _installed: ClassVar[weakref.WeakKeyDictionary[Client, Direct]] = weakref.WeakKeyDictionary()
    #: clients found unfit, with the reason (checked and logged once per connection)
    _refused: ClassVar[weakref.WeakKeyDictionary[Client, str]] = weakref.WeakKeyDictionary()

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.routes: dict[int, RawCallback] = {}
        self._stats = nc.stats
        self._send_command = nc._send_command
        self._flush_pending = nc._flush_pending
        self._answers: list[bytes] = []
        self._writers: set[asyncio.Task[None]] = set()
        #: writes of collected answers (each one system call, for any number of acks)
        self.writes = 0

    @classmethod
    def install(cls, nc: Client) -> Direct | None:
        """``nc``'s direct dispatch, installed on first use; ``None`` if its nats-py differs"""
        direct = cls._installed.get(nc)
        if direct is not None or nc in cls._refused:
            return direct
        reason = self_check(nc)
        if reason is not None:
            cls._refused[nc] = reason
            log.warning(
                "direct dispatch is off on this connection, messages take nats-py's slower "
                "Msg path: %s (nats-py %s; tested with %s)",
                reason,
                nats_py_version(),
                ", ".join(TESTED_NATS_PY),
            )
            return None
        direct = cls(nc)
        parser = nc._ps
        parser.routes = direct.routes  # type: ignore[attr-defined]
        parser.__class__ = FastParser
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

    def unroute(self, sub: Subscription) -> None:
        """Give ``sub``'s messages back to nats-py's normal path"""
        self.routes.pop(getattr(sub, "_id", -1), None)

    def answer(self, reply: bytes, command_tail: bytes) -> None:
        """
        Publish an ack (``command_tail`` = `` <size>\\r\\n<body>\\r\\n``) to ``reply``

        Collected, and written with the others of the reads within :data:`ACK_WINDOW_S`
        (a task started by the first): a fleet's events trickle in one socket read
        each, and one write per read would cost a system call per event.
        """
        answers = self._answers
        answers.append(b"PUB " + reply + command_tail)
        if len(answers) == 1:
            writer = asyncio.get_running_loop().create_task(self._write_answers())
            self._writers.add(writer)  # the loop keeps weak references only
            writer.add_done_callback(self._writers.discard)

    async def _write_answers(self) -> None:
        await asyncio.sleep(ACK_WINDOW_S)
        answers, self._answers = self._answers, []
        nc = self.nc
        if not answers or nc.is_closed:
            return  # never acknowledged: the server redelivers them
        command = b"".join(answers)
        stats = self._stats
        self.writes += 1
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


def route(nc: Client, sub: Subscription, callback: RawCallback) -> Direct | None:
    """
    Hand ``sub``'s messages to ``callback`` straight from the parser

    :returns: the client's :class:`Direct`, or ``None`` if the installed nats-py
        does not allow it (``sub`` then keeps its own callback)
    """
    sid = getattr(sub, "_id", None)
    if not isinstance(sid, int):
        log.warning(
            "direct dispatch is off for this subscription, its messages take nats-py's "
            "slower Msg path: Subscription._id is not an int (nats-py %s; tested with %s)",
            nats_py_version(),
            ", ".join(TESTED_NATS_PY),
        )
        return None
    direct = Direct.install(nc)
    if direct is not None:
        direct.routes[sid] = callback
    return direct


#: how long the acks of one socket read wait for those of the next reads, to be written
#: together: at most one write per window, however many events trickle in (their
#: ``ack_wait`` is 30 s; an ack a connection loss drops means one redelivery, a duplicate)
ACK_WINDOW_S: Final = 0.02

#: the rest of an ack's ``PUB <reply>`` command: size and body
ACK_TAIL: Final = b" 4\r\n+ACK\r\n"
NAK_TAIL: Final = b" 4\r\n-NAK\r\n"
TERM_TAIL: Final = b" 5\r\n+TERM\r\n"


def parse_headers(raw: bytes) -> dict[str, str]:
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
