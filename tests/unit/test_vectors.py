"""docs/protocol.md: the test vectors are current and decode the same with two decoders"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import msgpack
import msgspec
import pytest
import vectors

from remote_agent import events as ev

_VECTOR = re.compile(r"#### `(\w+)`\n\n```hex\n([0-9a-f\n]+)```\n\n```json\n(.*?)\n```", re.S)
_REJECTED = re.compile(r"^\| `([0-9a-f]+)` \| (.+) \|$", re.M)


def _documented() -> list[tuple[str, bytes, Any]]:
    text = vectors.DOC.read_text()
    return [
        (kind, bytes.fromhex(hexdump.replace("\n", "")), json.loads(value))
        for kind, hexdump, value in _VECTOR.findall(text)
    ]


def _as_json(value: Any) -> Any:
    """What a JSON reader sees of a reference-decoded value: timestamps in RFC 3339"""
    if isinstance(value, dt.datetime):
        return msgspec.json.decode(msgspec.json.encode(value))
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value


def test_document_is_current() -> None:
    text = vectors.DOC.read_text()
    start, end = text.index(vectors.BEGIN), text.index(vectors.END) + len(vectors.END)
    assert text[start:end] == vectors.render(), "run: python tests/vectors.py"


def test_every_message_type_has_a_vector() -> None:
    kinds = [kind for kind, _, _ in _documented()]
    assert sorted(kinds) == sorted(ev.kind_of(t) for t in ev.MESSAGE_TYPES)


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
        with pytest.raises(ev.SchemaError):
            ev.decode(bytes.fromhex(hexdump))
