"""
For any stream content, the live registry, the rebuilt one and the timeline agree

The stream is modelled as the server keeps it: messages in stream order, a
``LAST_PER_SUBJECT`` read that yields the last message of every subject, and
deliveries of the durable consumer in any order and any number of times. The
handlers are the product's own: the consumer's (:func:`broker.manager.handler.event_handler`)
and the rebuild's (:func:`broker.manager.handler.event_reader`).
``tests/integration/test_hostile_manager.py`` checks the same on a real server.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.drones import FakeDrone

from broker.jetstream.messages import metadata
from broker.manager.handler import event_handler, event_reader
from broker.manager.registry import Registry
from broker.manager.timeline import build, check_message
from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import Namespace

NS = Namespace()
SITE = "site1"
DRONES = ("site1-0000000001", "site1-0000000002", "site1-0000000003")
KINDS = ("heartbeat", "payload_started", "drained", "agent_started")
T0 = 1_800_000_000.0

Message = tuple[str, bytes, dict[str, str] | None]  # subject, data, stored headers


def _event(drone: str, kind: str, seq: int, incarnation: str) -> ev.Event:
    fake = FakeDrone(SITE, drone, incarnation=incarnation, seq=seq - 1)
    if kind == "heartbeat":
        return fake.heartbeat()
    if kind == "payload_started":
        return fake.payload_started(f"{seq}.0")
    if kind == "drained":
        return fake.drained()
    return fake.started()


@st.composite
def _message(draw: st.DrawFn) -> Message:
    """A message as stored, with the headers its writer (or a relaying server) gave it"""
    subject, data = draw(_body())
    try:
        message_id = ev.decode_event(data, max_size=len(data)).id
    except SchemaError:
        message_id = "no-event"
    how = draw(st.sampled_from(["writer", "writer", "writer", "none", "other_id", "relayed"]))
    if how == "none":  # a direct get's answer asked for without headers
        return subject, data, None
    if how == "other_id":
        return subject, data, {"Nats-Msg-Id": message_id + "x"}
    if how == "relayed":
        return subject, data, {"Nats-Msg-Id": message_id, "Nats-Subject": subject}
    return subject, data, {"Nats-Msg-Id": message_id}


@st.composite
def _body(draw: st.DrawFn) -> tuple[str, bytes]:
    drone = draw(st.sampled_from(DRONES))
    kind = draw(st.sampled_from(KINDS))
    subject = NS.event(SITE, drone, kind)
    seq = draw(st.one_of(st.integers(1, 50), st.just(2**64 - 1), st.integers(0, 2**63)))
    incarnation = draw(st.sampled_from(["inc1", "inc2", "inc3"]))
    how = draw(
        st.sampled_from(
            ["valid", "valid", "valid", "garbage", "nested", "other_drone", "other_kind", "big"]
        )
    )
    if how == "garbage":
        return subject, draw(st.binary(max_size=40))
    if how == "nested":
        return subject, b"\x82\xa1x" + b"\x91" * 3000 + b"\xc0\xa4kind\xa9heartbeat"
    if how == "other_drone":
        other = draw(st.sampled_from([d for d in DRONES if d != drone]))
        return subject, ev.encode(_event(other, kind, seq, incarnation))
    if how == "other_kind":
        other_kind = draw(st.sampled_from([k for k in KINDS if k != kind]))
        return subject, ev.encode(_event(drone, other_kind, seq, incarnation))
    event = _event(drone, kind, seq, incarnation)
    if how == "big":
        event = msgspec.structs.replace(event, id="x" * DEFAULT_MAX_SIZE)
    return subject, ev.encode(event)


def _reply(stream_seq: int, delivered: int = 1) -> str:
    """The reply subject JetStream gives the message stored at ``stream_seq``"""
    stored_ns = int((T0 + stream_seq) * 1e9)
    return f"$JS.ACK.COBALD_EVENTS.c.{delivered}.{stream_seq}.{stream_seq}.{stored_ns}.0"


def _registry() -> Registry:
    return Registry(NS, lost_after_s=90.0)


def _rebuilt(stream: list[Message]) -> Registry:
    """What rebuild() does, on the server's semantics"""
    registry = _registry()
    last: dict[str, int] = {}
    for number, (subject, _, _) in enumerate(stream, 1):
        last[subject] = number
    hidden: set[str] = set()
    read = event_reader(registry, hidden)
    for number in sorted(last.values()):
        subject, data, headers = stream[number - 1]
        read(subject, _reply(number), data, headers)
    resolve = event_reader(registry, None)
    for number, (subject, data, headers) in enumerate(stream, 1):
        if subject in hidden:
            resolve(subject, _reply(number), data, headers)
    return registry


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(_message(), max_size=40), data=st.data())
def test_live_rebuilt_and_timeline_agree(stream: list[Message], data: st.DataObject) -> None:
    live = _registry()
    handle = event_handler(live)
    deliveries = list(enumerate(stream, 1))
    order = data.draw(st.permutations(deliveries), label="delivery order")
    again = data.draw(st.lists(st.sampled_from(deliveries or [(0, ("", b"", None))]), max_size=10))
    for number, (subject, payload, headers) in [*order, *(d for d in again if d[0])]:
        handle(subject, _reply(number), payload, headers)

    rebuilt = _rebuilt(stream)
    assert dict(rebuilt.views()) == dict(live.views())

    for drone in DRONES:
        root = NS.drone_root(SITE, drone) + "."
        accepted = []
        for number, (subject, payload, headers) in enumerate(stream, 1):
            if subject.startswith(root):
                try:
                    accepted.append((number, check_message(payload, subject, NS, headers)))
                except Exception:
                    continue
        rows = build(accepted, heartbeats=True)
        view = live.view(SITE, drone)
        if view is None or view.stream_seq is None:
            assert rows == []
            continue
        assert rows[-1].stream_seq == view.stream_seq
        assert rows[-1].drone_state == str(view.state)
        assert len(rows) == len(accepted)


def test_the_model_replies_as_the_server_does() -> None:
    assert metadata(_reply(7, 2)) == (7, 2, T0 + 7, 0)
