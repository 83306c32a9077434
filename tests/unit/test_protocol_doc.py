"""
docs/protocol.md says exactly what the decoder and ``cobald-remote protocol decode`` do

Every ``$ echo HEX | xxd -r -p | cobald-remote protocol decode`` example of the
document is run through the command's own code, and its output must be the line
the document shows; the encoding rules the document states are checked against
the decoder one by one, so that document and code cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
import io
import math
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest
from support import vectors
from support.processes import CLI

from broker import cli
from remote_agent.gate import messages as gate
from remote_agent.protocol import bootstrap
from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import check_sender
from remote_agent.protocol.names import Namespace

_EXAMPLE = re.compile(
    r"^\$ echo ([0-9a-f]+) \| xxd -r -p \| cobald-remote protocol decode((?: \S+)*)\n(.+)$",
    re.M,
)
_CONSOLE = re.compile(r"```console\n(.*?)```", re.S)


def _examples() -> list[tuple[str, list[str], str]]:
    text = vectors.DOC.read_text()
    blocks = "".join(_CONSOLE.findall(text))
    return [(hexdump, opts.split(), out) for hexdump, opts, out in _EXAMPLE.findall(blocks)]


def _decode_tool(
    data: bytes, options: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code = cli.main(["protocol", "decode", *options])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_document_has_examples_of_every_check() -> None:
    outputs = [out for _, _, out in _examples()]
    assert len(outputs) >= 20
    for needed in (
        "exceeds the limit",
        "malformed message:",
        "Invalid value 'foo' - at `$.kind`",
        "unsupported message schema version 2",
        "missing required field",
        "got `float` - at `$.seq`",
        "got `bytes`",
        "must be a subject token",
        "with a timezone component",
        '{"kind":"status"',
    ):
        assert any(needed in out for out in outputs), needed


@pytest.mark.parametrize(("hexdump", "options", "expected"), _examples(), ids=lambda x: str(x)[:24])
def test_documented_output_is_what_the_tool_prints(
    hexdump: str,
    options: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    code, out, err = _decode_tool(bytes.fromhex(hexdump), options, monkeypatch, capsys)
    if expected.startswith("cobald-remote: "):
        assert (code, out, err) == (1, "", expected + "\n")
    else:
        assert (code, err) == (0, "")
        assert out == expected + "\n"


def test_the_command_line_prints_the_same() -> None:
    """One example through the real command line, as an operator types it"""
    hexdump, options, expected = next(e for e in _examples() if "$.kind" in e[2])
    done = subprocess.run(
        [*CLI, "protocol", "decode", *options],
        input=bytes.fromhex(hexdump),
        capture_output=True,
        check=False,
        cwd=Path(cli.__file__).resolve().parent.parent,
    )
    assert (done.returncode, done.stdout, done.stderr.decode()) == (1, b"", expected + "\n")


def test_the_documented_sender_error_is_what_the_check_says() -> None:
    ns = Namespace()
    drained = vectors.example(ev.Drained)
    with pytest.raises(SchemaError) as err:
        check_sender(drained, ns.event(vectors.SITE, vectors.RELEASED_DRONE, "drained"), ns)
    assert f"\n{err.value}\n" in vectors.DOC.read_text()


# ------------------------------------------------------------ the encoding rules


def _raw(message_type: type[ev.Message], **changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.to_builtins(
        vectors.example(message_type), builtin_types=(dt.datetime,)
    )
    raw.update(changes)
    return raw


def _pack(raw: dict[str, Any]) -> bytes:
    return msgpack.packb(raw, datetime=True)


_AT = "\x00time\x00"


def _with_time(encoded: bytes) -> bytes:
    """The ``drained`` example with its ``at`` replaced by raw MessagePack bytes"""
    return _pack(_raw(ev.Drained, at=_AT)).replace(msgpack.packb(_AT), encoded)


@pytest.mark.parametrize(
    "value",
    [30, 0, 255, 65_535, 2**32 - 1, 2**64 - 1, 30.0],
)
def test_durations_may_be_integers_of_any_width(value: float) -> None:
    beat = ev.decode(_pack(_raw(ev.Heartbeat, interval_s=value)))
    assert isinstance(beat, ev.Heartbeat) and beat.interval_s == float(value)
    done = ev.decode(_pack(_raw(ev.PayloadFinished, duration_s=value)))
    assert isinstance(done, ev.PayloadFinished) and done.duration_s == float(value)


def test_durations_may_be_float32() -> None:
    data = _pack(_raw(ev.Heartbeat, interval_s=0.0))
    at = data.rindex(b"\xcb")  # the float 64 of interval_s, the last key of the example
    data = data[:at] + b"\xca" + struct.pack(">f", 30.0)
    beat = ev.decode(data)
    assert isinstance(beat, ev.Heartbeat) and beat.interval_s == 30.0


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), float("-inf"), True, "30"])
def test_bad_durations_are_rejected(value: object) -> None:
    with pytest.raises(SchemaError, match=r"at `\$\.interval_s`"):
        ev.decode(_pack(_raw(ev.Heartbeat, interval_s=value)))
    with pytest.raises(SchemaError, match=r"at `\$\.duration_s`"):
        ev.decode(_pack(_raw(ev.PayloadFinished, duration_s=value)))


def test_the_largest_finite_duration_is_accepted() -> None:
    done = ev.decode(_pack(_raw(ev.PayloadFinished, duration_s=sys.float_info.max)))
    assert isinstance(done, ev.PayloadFinished) and done.duration_s == sys.float_info.max


def _floats(node: mi.Type, path: str) -> list[tuple[str, mi.FloatType]]:
    """Every float type reachable from ``node`` (struct fields, unions, lists), by path"""
    if isinstance(node, mi.FloatType):
        return [(path, node)]
    if isinstance(node, mi.StructType):
        return [f for field in node.fields for f in _floats(field.type, f"{path}.{field.name}")]
    if isinstance(node, mi.UnionType):
        return [f for t in node.types for f in _floats(t, path)]
    if isinstance(node, mi.ListType):
        return _floats(node.item_type, f"{path}[]")
    return []


_MESSAGES = (
    *ev.MESSAGE_TYPES,
    *bootstrap.AnyBootstrapRequest.__args__,
    *bootstrap.AnyBootstrapReply.__args__,
    *gate.AnyGateRequest.__args__,
    *gate.AnyGateReply.__args__,
)


def test_every_float_of_every_message_is_finite() -> None:
    """Each float field is a :data:`~remote_agent.protocol.fields.Seconds`: no inf, no NaN"""
    floats = [f for t in _MESSAGES for f in _floats(mi.type_info(t), t.__name__)]
    assert {path for path, _ in floats} >= {
        "Heartbeat.interval_s",
        "PayloadFinished.duration_s",
        "JobExitRequest.duration_s",
        "Heartbeat.snapshot.end.in_s",
        "Heartbeat.snapshot.payloads[].requested_s",
        "PrepareJobRequest.requested_s",
    }
    for path, number in floats:
        assert number.le is not None and math.isfinite(number.le), path
        assert number.ge is not None and math.isfinite(number.ge), path


@pytest.mark.parametrize("value", [0, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1])
def test_seq_takes_every_unsigned_64_bit_value(value: int) -> None:
    event = ev.decode(_pack(_raw(ev.Drained, seq=value)))
    assert isinstance(event, ev.Drained) and event.seq == value


@pytest.mark.parametrize("value", [7.0, float(2**53), True, -1])
def test_seq_must_be_a_non_negative_integer(value: object) -> None:
    with pytest.raises(SchemaError, match=r"at `\$\.seq`"):
        ev.decode(_pack(_raw(ev.Drained, seq=value)))


_SECONDS = 1_773_854_862


@pytest.mark.parametrize(
    ("encoded", "expected"),
    [
        (b"\xd6\xff" + struct.pack(">I", _SECONDS), dt.datetime(2026, 3, 18, 17, 27, 42)),
        (
            b"\xd7\xff" + struct.pack(">Q", (250_000_000 << 34) | _SECONDS),
            dt.datetime(2026, 3, 18, 17, 27, 42, 250_000),
        ),
        (
            b"\xc7\x0c\xff" + struct.pack(">Iq", 250_000_400, _SECONDS),
            dt.datetime(2026, 3, 18, 17, 27, 42, 250_000),
        ),
        (b"\xc7\x0c\xff" + struct.pack(">Iq", 0, -86_400), dt.datetime(1969, 12, 31)),
    ],
    ids=["4 bytes", "8 bytes", "12 bytes", "12 bytes before 1970"],
)
def test_every_timestamp_width_is_accepted(encoded: bytes, expected: dt.datetime) -> None:
    assert ev.decode(_with_time(encoded)).at == expected.replace(tzinfo=dt.UTC)  # type: ignore[union-attr]


def test_times_may_be_strings_with_a_zone_only() -> None:
    instant = dt.datetime(2026, 3, 18, 17, 27, 42, tzinfo=dt.UTC)
    for text in ("2026-03-18T17:27:42Z", "2026-03-18T19:27:42+02:00"):
        assert ev.decode(_pack(_raw(ev.Drained, at=text))).at == instant  # type: ignore[union-attr]
    for bad in ("2026-03-18T17:27:42", _SECONDS, float(_SECONDS)):
        with pytest.raises(SchemaError, match=r"at `\$\.at`"):
            ev.decode(_pack(_raw(ev.Drained, at=bad)))


def test_our_writers_send_utc_timestamps_in_the_smallest_width() -> None:
    def encoded(value: dt.datetime) -> bytes:
        return msgspec.msgpack.encode(value)

    zone = dt.timezone(dt.timedelta(hours=2))
    assert encoded(dt.datetime(2026, 3, 18, 19, 27, 42, tzinfo=zone))[:2] == b"\xd6\xff"
    assert encoded(dt.datetime(2026, 3, 18, 17, 27, 42, 1, tzinfo=dt.UTC))[:2] == b"\xd7\xff"
    assert encoded(dt.datetime(1969, 1, 1, tzinfo=dt.UTC))[:3] == b"\xc7\x0c\xff"
    assert b"\xa2at\xd7\xff" in ev.encode(vectors.example(ev.Drained))


def test_keys_may_come_in_any_order_and_unknown_keys_are_ignored_at_every_level() -> None:
    raw = _raw(ev.Drained)
    raw["snapshot"]["future"] = {"nested": [1, {"deeper": b"\x00"}]}
    raw["drain_intent_v2"] = msgpack.ExtType(7, b"x")
    reordered = dict(reversed(list(raw.items())))
    assert next(iter(reordered)) != "kind"
    assert ev.decode(_pack(reordered)) == vectors.example(ev.Drained)


def test_a_repeated_key_counts_with_its_last_value() -> None:
    items = [*_raw(ev.Drained).items(), ("seq", 99)]
    body = b"".join(msgpack.packb(k) + msgpack.packb(v, datetime=True) for k, v in items)
    assert ev.decode(bytes([0x80 | len(items)]) + body).seq == 99  # type: ignore[union-attr]


def test_keys_with_defaults_may_be_omitted_but_not_nil() -> None:
    raw = _raw(ev.PayloadStarted)
    del raw["slot"], raw["v"]
    started = ev.decode(_pack(raw))
    assert isinstance(started, ev.PayloadStarted) and (started.slot, started.v) == ("", 1)
    with pytest.raises(SchemaError, match=r"got `None` - at `\$\.slot`"):
        ev.decode(_pack(_raw(ev.PayloadStarted, slot=None)))


def test_strings_must_be_str_not_bin() -> None:
    with pytest.raises(SchemaError, match=r"got `bytes` - at `\$\.job_id`"):
        ev.decode(_pack(_raw(ev.PayloadStarted, job_id=b"1234.0")))
