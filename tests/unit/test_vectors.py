"""docs/protocol.md: the test vectors are current and decode the same with two decoders"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from typing import Any, TypeVar

import msgpack
import msgspec
import pytest
from support import vectors

from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.names import dedupe_id

_VECTOR = re.compile(r"#### `(\w+)`[^\n]*\n\n```hex\n([0-9a-f\n]+)```\n\n```json\n(.*?)\n```", re.S)
_REJECTED = re.compile(r"^\| `([0-9a-f]+)` \| (.+) \|$", re.M)


def _documented() -> list[tuple[str, bytes, Any]]:
    text = vectors.DOC.read_text()
    return [
        (kind, bytes.fromhex(hexdump.replace("\n", "")), json.loads(value))
        for kind, hexdump, value in _VECTOR.findall(text)
    ]


def _as_json(value: Any) -> Any:
    """What a JSON reader sees of a reference-decoded value: RFC 3339 times, base64 bin"""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dt.datetime):
        return msgspec.json.decode(msgspec.json.encode(value))
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value


def _section(begin: str, end: str) -> str:
    text = vectors.DOC.read_text()
    return text[text.index(begin) : text.index(end) + len(end)]


def test_document_is_current() -> None:
    assert _section(vectors.BEGIN, vectors.END) == vectors.render(), (
        "run: python tests/support/vectors.py"
    )


def test_key_table_is_current() -> None:
    section = _section(vectors.FIELDS_BEGIN, vectors.FIELDS_END)
    assert section == vectors.render_fields(), "run: python tests/support/vectors.py"


def test_every_message_type_has_a_vector() -> None:
    kinds = {kind for kind, _, _ in _documented()}
    assert kinds == {ev.kind_of(t) for t in ev.MESSAGE_TYPES}
    assert len(_documented()) == len(vectors.EXAMPLES)


def test_every_key_is_in_the_key_table() -> None:
    table = vectors.render_fields()
    for message_type in ev.MESSAGE_TYPES:
        kind = ev.kind_of(message_type)
        for field in msgspec.structs.fields(message_type):
            own = f"| `{kind}` | `{field.encode_name}` |"
            common = f"| every event | `{field.encode_name}` |"
            assert own in table or common in table, (kind, field.encode_name)


def _events_of(drone: str) -> list[ev.Event]:
    return [m for m in vectors.EXAMPLES if isinstance(m, ev.Event) and m.drone == drone]


@pytest.mark.parametrize("drone", [vectors.DRONE, vectors.RELEASED_DRONE])
def test_event_vectors_are_one_life_each(drone: str) -> None:
    """Realistic vectors: each drone's events in order, one incarnation, growing seq and time"""
    events = _events_of(drone)
    assert len({e.incarnation for e in events}) == 1
    assert [e.seq for e in events] == sorted({e.seq for e in events})
    assert [e.at for e in events] == sorted(e.at for e in events)
    for event in events:
        assert event.id == dedupe_id(event.drone, event.incarnation, event.seq)
        assert event.seq > 2**32  # an agent starts at its clock in microseconds
        assert event.snapshot.since <= event.at
        assert event.snapshot.started_at <= event.snapshot.since


def test_event_vectors_carry_the_snapshot_of_their_event() -> None:
    snapshots = {
        ev.kind_of(type(e)): e.snapshot for e in vectors.EXAMPLES if isinstance(e, ev.Event)
    }
    assert len({msgspec.msgpack.encode(s) for s in snapshots.values()}) >= 8
    S = ev.DroneState
    assert snapshots["agent_started"].state is S.STARTING
    assert snapshots["agent_started"].worker_pid is None
    assert snapshots["gate_opened"].gate_open and snapshots["gate_opened"].state is S.IDLE
    started = example_of(ev.PayloadStarted)
    assert started.job_id in {p.job_id for p in started.snapshot.payloads}
    finished = example_of(ev.PayloadFinished)
    assert finished.job_id not in {p.job_id for p in finished.snapshot.payloads}
    for kind in ("drain_requested", "drain_accepted", "gate_closed", "draining"):
        assert snapshots[kind].state is S.DRAINING and not snapshots[kind].gate_open
        assert snapshots[kind].drain == example_of(ev.DrainRequested).intent
    assert example_of(ev.DrainAccepted).payloads == len(snapshots["drain_accepted"].payloads)
    assert snapshots["drained"].state is S.DRAINED and not snapshots["drained"].payloads
    assert snapshots["worker_exited"].worker_pid is None
    assert snapshots["agent_exiting"].state is S.EXITING
    assert snapshots["released"].state is S.RELEASED and not snapshots["released"].gate_open
    assert snapshots["heartbeat"].state is S.BUSY and len(snapshots["heartbeat"].payloads) == 2


E = TypeVar("E", bound=ev.Event)


def example_of(event_type: type[E]) -> E:
    return vectors.example(event_type)


@pytest.mark.parametrize(("kind", "data", "value"), _documented(), ids=lambda x: str(x)[:20])
def test_reference_msgpack_decodes_vector(kind: str, data: bytes, value: Any) -> None:
    decoded = msgpack.unpackb(data, timestamp=3, strict_map_key=True)
    assert _as_json(decoded) == value
    assert decoded["kind"] == kind


@pytest.mark.parametrize(("kind", "data", "value"), _documented(), ids=lambda x: str(x)[:20])
def test_project_decoder_decodes_vector(kind: str, data: bytes, value: Any) -> None:
    message = ev.decode(data)
    assert ev.kind_of(type(message)) == kind
    assert json.loads(ev.to_json(message)) == value
    assert ev.encode(message) == data


def test_rejected_vectors_are_rejected() -> None:
    rejected = _REJECTED.findall(vectors.DOC.read_text())
    assert len(rejected) >= 4
    for hexdump, _why in rejected:
        with pytest.raises(SchemaError):
            ev.decode(bytes.fromhex(hexdump))


#: the non-finite numbers of the rejected vectors, each the last value of its event
_NON_FINITE = re.compile(r"(cb7ff0000000000000|cbfff0000000000000|cb7ff8000000000000|ca7f800000)\Z")
_THIRTY = "cb403e000000000000"


def test_rejected_numbers_are_the_only_fault_of_their_vectors() -> None:
    """A non-finite duration is rejected for itself: the same event with ``30.0`` is valid"""
    numbers = [
        (hexdump, match)
        for hexdump, _why in _REJECTED.findall(vectors.DOC.read_text())
        if (match := _NON_FINITE.search(hexdump)) is not None
    ]
    assert {m.group(1) for _, m in numbers} >= {"cb7ff0000000000000", "ca7f800000"}
    kinds = set()
    for hexdump, match in numbers:
        with pytest.raises(SchemaError, match=r"at `\$\.(interval_s|duration_s)`"):
            ev.decode(bytes.fromhex(hexdump))
        valid = ev.decode(bytes.fromhex(hexdump[: match.start()] + _THIRTY))
        assert isinstance(valid, ev.Heartbeat | ev.PayloadFinished)
        kinds.add(ev.kind_of(type(valid)))
    assert kinds == {"heartbeat", "payload_finished"}
