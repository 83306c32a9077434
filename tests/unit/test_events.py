"""The wire schema: round trips, strict decoding, subjects"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.vectors import DRONE, EXAMPLES, SITE, T0, example

from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import check_sender
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE, MAX_PAYLOADS
from remote_agent.protocol.names import Namespace, check_token


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(ev.MESSAGE_TYPES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: ev.kind_of(type(m)))
def test_round_trip(message: ev.Message) -> None:
    data = ev.encode(message)
    assert ev.decode(data) == message
    assert msgpack.unpackb(data, timestamp=3)["kind"] == ev.kind_of(type(message))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: ev.kind_of(type(m)))
def test_family_decoders_accept_only_their_family(message: ev.Message) -> None:
    data = ev.encode(message)
    families = {
        ev.decode_event: ev.Event,
        ev.decode_command: ev.Command,
        ev.decode_reply: (ev.Reply, ev.ErrorReply),
        ev.decode_record: ev.DroneRecord,
    }
    for decoder, family in families.items():
        if isinstance(message, family):
            assert decoder(data) == message
        else:
            with pytest.raises(SchemaError, match="invalid"):
                decoder(data)


def _drained(**changes: object) -> dict[str, object]:
    raw: dict[str, object] = msgspec.to_builtins(example(ev.Drained), builtin_types=(dt.datetime,))
    assert raw["kind"] == "drained"
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"seq": "7"}, r"Expected `int`, got `str` - at `\$.seq`"),
        ({"seq": -1}, r"Expected `int` >= 0 - at `\$.seq`"),
        ({"kind": "teleported"}, r"Invalid value 'teleported' - at `\$.kind`"),
        ({"v": 2}, r"unsupported message schema version 2 \(this side speaks 1\)"),
        ({"v": 0}, r"unsupported message schema version 0"),
        ({"v": "1"}, r"Expected `int`, got `str` - at `\$.v`"),
        ({"site": "a.b"}, r"`site` must be a subject token \(1-128 of .*\), not 'a\.b'"),
        ({"drone": "x>"}, r"`drone` must be a subject token"),
        ({"incarnation": "one two"}, r"`incarnation` must be a subject token"),
        ({"site": ""}, r"Expected `str` of length >= 1 - at `\$.site`"),
        ({"drone": "d" * 129}, r"Expected `str` of length <= 128 - at `\$.drone`"),
        ({"at": "yesterday"}, r"at `\$.at`"),
        ({"at": "2026-03-18T17:27:42"}, r"at `\$.at`"),  # naive time: no zone
    ],
)
def test_wrong_values_are_schema_errors(changes: dict[str, object], error: str) -> None:
    with pytest.raises(SchemaError, match=error):
        ev.decode(msgpack.packb(_drained(**changes), datetime=True))


def test_unknown_version_is_named_even_if_fields_changed() -> None:
    raw = _drained(v=3)
    del raw["seq"]
    with pytest.raises(SchemaError, match="unsupported message schema version 3"):
        ev.decode(msgpack.packb(raw, datetime=True))


def test_missing_field() -> None:
    raw = _drained()
    del raw["incarnation"]
    with pytest.raises(SchemaError, match="missing required field `incarnation`"):
        ev.decode_event(msgpack.packb(raw, datetime=True))


def test_unknown_fields_are_ignored() -> None:
    raw = _drained(future_field={"nested": [1, 2]})
    assert ev.decode(msgpack.packb(raw, datetime=True)) == example(ev.Drained)


def test_size_limit() -> None:
    message = ev.encode(EXAMPLES[0])
    with pytest.raises(SchemaError, match=r"of \d+ bytes exceeds the limit of 10 bytes"):
        ev.decode(message, max_size=10)
    big = msgpack.packb(_drained(padding="x" * 2_000_000), datetime=True)
    with pytest.raises(SchemaError, match="exceeds the limit of 65536 bytes"):
        ev.decode_event(big)
    assert ev.decode_event(big, max_size=len(big)) == example(ev.Drained)


def _containers(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)


_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    _containers,
    max_leaves=20,
)


def _decode_or_schema_error(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> None:
    try:
        message = ev.decode(data, max_size=max_size)
    except SchemaError as err:
        assert str(err)
    else:
        assert isinstance(message, ev.MESSAGE_TYPES)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes_only_raise_schema_errors(data: bytes) -> None:
    _decode_or_schema_error(data)


@settings(max_examples=300)
@given(st.sampled_from(EXAMPLES), st.data())
def test_mutated_messages_only_raise_schema_errors(
    message: ev.Message, data: st.DataObject
) -> None:
    raw = bytearray(ev.encode(message))
    for _ in range(data.draw(st.integers(1, 8))):
        where = data.draw(st.integers(0, len(raw)))
        action = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip" and where < len(raw):
            raw[where] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            raw[where:where] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "delete" and where < len(raw):
            del raw[where]
        elif action == "truncate":
            del raw[where:]
    _decode_or_schema_error(bytes(raw))


@settings(max_examples=200)
@given(_ANY)
def test_random_msgpack_values_only_raise_schema_errors(value: object) -> None:
    _decode_or_schema_error(msgpack.packb(value))


@settings(max_examples=300)
@given(st.sampled_from(EXAMPLES), st.data(), _ANY)
def test_mutated_fields_only_raise_schema_errors(
    message: ev.Message, data: st.DataObject, value: object
) -> None:
    raw = msgspec.to_builtins(message, builtin_types=(dt.datetime,))
    key = data.draw(st.sampled_from(sorted(raw)) | st.text(max_size=10))
    raw[key] = value
    _decode_or_schema_error(msgpack.packb(raw, datetime=True))


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(st.integers(1_048_577, 1_600_000), st.integers(0, 2**32))
def test_oversized_input_only_raises_schema_errors(size: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    with pytest.raises(SchemaError, match="exceeds the limit"):
        ev.decode(data)
    # and with the limit lifted, still only schema errors
    _decode_or_schema_error(data, max_size=size)
    _decode_or_schema_error(msgpack.packb({"kind": "drained", "x": data}), max_size=2 * size)


@pytest.mark.parametrize("bad", ["", "a.b", "*", ">", "a b", "tab\t", "é", "x" * 129, "a\n"])
def test_bad_tokens(bad: str) -> None:
    with pytest.raises(SchemaError, match="no dots, wildcards or whitespace"):
        check_token(bad)
    with pytest.raises(SchemaError):
        Namespace().event(bad, DRONE, "drained")
    with pytest.raises(SchemaError):
        Namespace().command(SITE, bad)
    with pytest.raises(SchemaError):
        Namespace(bad)


def test_subjects() -> None:
    ns = Namespace("cr")
    assert ns.event(SITE, DRONE, "drained") == f"cr.{SITE}.{DRONE}.evt.drained"
    assert ns.drone_events(SITE, DRONE) == f"cr.{SITE}.{DRONE}.evt.>"
    assert ns.command(SITE, DRONE) == f"cr.{SITE}.{DRONE}.cmd"
    assert ns.manager_note(SITE, DRONE, "tardis_state") == f"cr.{SITE}.{DRONE}.mgr.tardis_state"
    assert ns.record_key(SITE, DRONE) == f"{SITE}.{DRONE}"
    assert ns.event_stream == "CR_EVENTS"
    assert ns.record_bucket == "cr-drones"
    assert ns.parse_event_subject(ns.event(SITE, DRONE, "heartbeat")) == (SITE, DRONE, "heartbeat")
    for subject in ("cr.a.b.cmd", "other.a.b.evt.x", "cr.a.b.evt.x.y", f"cr.{SITE}.{DRONE}.mgr.x"):
        with pytest.raises(SchemaError, match="not an event subject"):
            ns.parse_event_subject(subject)


def test_a_drone_cannot_speak_for_another() -> None:
    ns = Namespace()
    drained = example(ev.Drained)
    assert isinstance(drained, ev.Drained)
    check_sender(drained, ns.event(SITE, DRONE, "drained"), ns)
    for subject in (
        ns.event(SITE, "site1-9999999999", "drained"),
        ns.event("site2", DRONE, "drained"),
        ns.event(SITE, DRONE, "heartbeat"),
    ):
        with pytest.raises(SchemaError, match="arrived on the subject of"):
            check_sender(drained, subject, ns)


def test_times_are_msgpack_timestamps() -> None:
    raw = msgpack.unpackb(ev.encode(example(ev.Drained)), timestamp=0)
    assert raw["at"] == msgpack.Timestamp.from_datetime(T0)


@pytest.mark.parametrize(
    "decoder",
    [
        ev.decode,
        ev.decode_event,
        ev.decode_command,
        ev.decode_reply,
        ev.decode_record,
        ev.decode_note,
    ],
)
@pytest.mark.parametrize("depth", [1_000, 20_000])
def test_deep_nesting_is_a_schema_error(decoder: Callable[[bytes], object], depth: int) -> None:
    """1.2 KB of nested arrays in an unknown field make msgspec recurse past Python's limit"""
    data = b"\x82\xa1x" + b"\x91" * depth + b"\xc0\xa4kind\xa9heartbeat"
    with pytest.raises(SchemaError, match="nested too deeply"):
        decoder(data)


def test_a_snapshot_lists_at_most_max_payloads() -> None:
    now = ev.utcnow()
    payloads = [ev.Payload(job_id=f"{n}.0", started_at=now) for n in range(MAX_PAYLOADS + 1)]
    snapshot = ev.Snapshot(
        state=ev.DroneState.BUSY, since=now, gate_open=True, payloads=payloads, started_at=now
    )
    event = msgspec.structs.replace(example(ev.Heartbeat), snapshot=snapshot)
    with pytest.raises(SchemaError, match="length <= 256"):
        ev.decode_event(ev.encode(event))
    bounded = msgspec.structs.replace(snapshot, payloads=payloads[:-1])
    assert ev.decode_event(ev.encode(msgspec.structs.replace(event, snapshot=bounded)))
