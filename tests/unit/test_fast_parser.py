"""
The consumer's protocol parser against nats-py's own, on the same bytes cut anywhere

``broker.jetstream.fastpath.FastParser`` replaces nats-py's parser on the manager's
connection (see ``docs/architecture.md``). Both are fed the same server
output, split into arbitrary chunks, and must hand the client exactly the
same calls; the parser's client here is a recorder standing where nats-py's
``Client`` stands (the parser's only collaborator), not a NATS server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib import metadata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.errors import ProtocolError
from nats.protocol.parser import Parser
from packaging.requirements import Requirement

from broker.jetstream.fastpath import TESTED_NATS_PY, FastParser, nats_py_version

Call = tuple[object, ...]


class Recorder:
    """Records what a parser hands to its client, in order"""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.stats = {"in_msgs": 0, "in_bytes": 0}

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        self.calls.append(("msg", sid, subject, reply, data, headers))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info: object) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, err: str) -> None:
        self.calls.append(("err", err))


def _msg(subject: bytes, sid: int, reply: bytes, payload: bytes) -> bytes:
    middle = b" " + reply if reply else b""
    return b"MSG %s %d%s %d\r\n%s\r\n" % (subject, sid, middle, len(payload), payload)


def _hmsg(subject: bytes, sid: int, reply: bytes, headers: bytes, payload: bytes) -> bytes:
    middle = b" " + reply if reply else b""
    total = len(headers) + len(payload)
    return b"HMSG %s %d%s %d %d\r\n%s%s\r\n" % (
        subject, sid, middle, len(headers), total, headers, payload
    )  # fmt: skip


_subjects = st.sampled_from([b"cobald.site1.d1.evt.heartbeat", b"_INBOX.abc", b"x"])
_replies = st.sampled_from([b"", b"$JS.ACK.S.c.1.2.3.1764503696123456789.0", b"_INBOX.r.1"])
# payloads that look like protocol lines, too
_payloads = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"", b"MSG x 1 2\r\n", b"PING\r\n", b"HMSG \r\n\r\n", b"\r\n"]),
)
_headers = st.sampled_from(
    [
        b"NATS/1.0\r\n\r\n",
        b"NATS/1.0\r\nNats-Msg-Id: a-b-1\r\n\r\n",
        b"NATS/1.0 100 Idle Heartbeat\r\n\r\n",
        b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 7\r\n\r\n",
    ]
)
_frames = st.one_of(
    st.builds(_msg, _subjects, st.integers(1, 9), _replies, _payloads),
    st.builds(_hmsg, _subjects, st.integers(1, 9), _replies, _headers, _payloads),
    st.sampled_from(
        [b"PING\r\n", b"PONG\r\n", b"+OK\r\n", b'INFO {"server_id":"x","max_payload":1048576}\r\n']
    ),
)


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    out, start = [], 0
    for point in [*points, len(data)]:
        out.append(data[start:point])
        start = point
    return out


async def _feed(parser: Parser, chunks: list[bytes]) -> None:
    for chunk in chunks:
        await parser.parse(chunk)


def _run(parser_type: type[Parser], chunks: list[bytes]) -> list[Call]:
    recorder = Recorder()
    parser = parser_type(recorder)
    if parser_type is FastParser:
        parser.routes = {}  # type: ignore[attr-defined]
    asyncio.run(_feed(parser, chunks))
    assert not parser.buf, "everything complete was consumed"
    return recorder.calls


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_frames, min_size=1, max_size=12),
    st.lists(st.integers(0, 4000), max_size=12),
)
def test_same_calls_as_nats_py_for_any_split(frames: list[bytes], cuts: list[int]) -> None:
    data = b"".join(frames)
    chunks = _chunks(data, cuts)
    assert _run(FastParser, chunks) == _run(Parser, chunks)


class Routing(Recorder):
    """A recorder whose ``_process_msg`` routes like the wrapper ``Direct`` installs"""

    def __init__(self, routes: dict[int, Callable[..., Awaitable[None] | None]]) -> None:
        super().__init__()
        self.routes = routes

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        route = self.routes.get(sid)
        if route is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        rest = route(subject, reply, data, headers)
        if rest is not None:
            await rest


@settings(max_examples=100, deadline=None)
@given(st.lists(_frames, min_size=1, max_size=12), st.lists(st.integers(0, 4000), max_size=12))
def test_routed_messages_reach_their_route_in_order(frames: list[bytes], cuts: list[int]) -> None:
    """
    Messages of a routed subscription go to its route, in order, and are counted

    Straight from this parser, or (in a read that nats-py's parser took
    over) through the client's wrapped ``_process_msg``.
    """
    data = b"".join(frames)
    chunks = _chunks(data, cuts)
    expected = _run(Parser, chunks)
    routed: list[tuple[str, int, bytes, bytes, bytes, bytes | None]] = []
    awaited = 0

    async def later() -> None:
        nonlocal awaited
        awaited += 1

    def route(
        subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> Awaitable[None] | None:
        routed.append(("msg", 3, subject, reply, data, headers))
        return later() if len(routed) % 2 else None  # what is returned is awaited

    routes: dict[int, Callable[..., Awaitable[None] | None]] = {3: route}
    recorder = Routing(routes)
    parser = FastParser(recorder)
    parser.routes = routes
    asyncio.run(_feed(parser, chunks))
    assert routed == [c for c in expected if c[0] == "msg" and c[1] == 3]
    assert recorder.calls == [c for c in expected if not (c[0] == "msg" and c[1] == 3)]
    assert awaited == (len(routed) + 1) // 2
    assert recorder.stats["in_msgs"] == len(routed)
    assert recorder.stats["in_bytes"] == sum(len(call[4]) for call in routed)


def test_finishes_a_message_nats_py_began() -> None:
    """After a PING nats-py's parser takes the rest of a read; a message it began is finished"""
    message = _hmsg(b"s", 1, b"r", b"NATS/1.0\r\n\r\n", b"payload")
    data = b"PING\r\n" + message + _msg(b"t", 2, b"", b"next")
    cut = len(b"PING\r\n") + len(message) - 5  # inside the first message's payload
    chunks = [data[:cut], data[cut:]]
    assert _run(FastParser, chunks) == _run(Parser, chunks)


@pytest.mark.parametrize(
    "line",
    [b"HMSG s 1 r x 9\r\n", b"HMSG s 1\r\n", b"MSG s one 4\r\n", b"MSG s 1 r 4 5 6\r\n"],
)
def test_malformed_message_lines_are_protocol_errors(line: bytes) -> None:
    for parser_type in (FastParser, Parser):
        with pytest.raises(ProtocolError):
            _run(parser_type, [line + b"data\r\n"])


def test_the_tests_run_the_nats_py_the_fast_path_was_tested_with() -> None:
    """The test extra pins it: another release is checked here before it is named"""
    requires = [Requirement(text) for text in metadata.requires("cobald-remote") or []]
    (pin,) = [r for r in requires if r.name == "nats-py" and r.marker is not None]
    assert pin.marker is not None and pin.marker.evaluate({"extra": "test"})
    (spec,) = pin.specifier
    assert spec.operator == "==" and spec.version in TESTED_NATS_PY
    assert nats_py_version() in TESTED_NATS_PY
