"""
Where the docs quote a rule or a default, it is the code's

The agent's options are held by ``tests/unit/test_agent_settings.py``; this holds the
``bus:`` section (``docs/tardis.md``), the subject-token rule and the retention rule.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import msgspec
import pytest

from broker.errors import ConfigError
from broker.manager.lifecycle import least_retain_lost_s
from broker.manager.registry import Registry
from broker.tardis.config import BusConfig
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import TARDIS_STATE, decode_note
from remote_agent.protocol.names import MAX_TOKEN, TOKEN_CHARS, TOKEN_RULE, check_token, is_token

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _bus_table() -> dict[str, str]:
    """``docs/tardis.md``'s table of the ``bus:`` keys: key -> the default column"""
    text = (DOCS / "tardis.md").read_text()
    rows = {}
    for row in text.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`[a-z_]+`", cells[0]):
            rows.setdefault(cells[0].strip("`"), cells[2])
    return rows


def test_the_documented_bus_defaults_are_the_configs() -> None:
    table = _bus_table()
    checked = []
    for field in msgspec.structs.fields(BusConfig):
        default = field.default
        if field.name not in table or isinstance(default, bool):
            continue
        if isinstance(default, int | float):
            assert table[field.name] == f"{default:g}", field.name
        elif isinstance(default, str):
            assert table[field.name] == f"`{default}`", field.name
        else:
            continue
        checked.append(field.name)
    assert {"lost_after_s", "lost_removal_after_s", "retain_lost_s", "prefix"} <= set(checked)


def test_every_quote_of_the_subject_token_rule_is_the_rule() -> None:
    quoted = [
        (path.name, int(length))
        for path in sorted(DOCS.glob("*.md"))
        for length in re.findall(r"1-(\d+) of `?A-Z a-z 0-9 _ -", path.read_text())
    ]
    assert len(quoted) >= 2
    assert [(name, length) for name, length in quoted if length != MAX_TOKEN] == []
    # the bootstrap token is as long as a subject token may be (docs/protocol.md)
    protocol = (DOCS / "protocol.md").read_text()
    assert f"str of 1-{MAX_TOKEN} characters: the drone's one-time token" in protocol
    assert f"1-{MAX_TOKEN} of A-Z a-z 0-9 _ -" == TOKEN_RULE


@pytest.mark.parametrize(
    "value",
    ["", "a", "A-z_09", "x" * MAX_TOKEN, "x" * (MAX_TOKEN + 1), "a.b", "a*", ">", "a b", "é"],
)
def test_the_names_and_the_wire_schema_apply_one_token_rule(value: str) -> None:
    """``is_token``, ``check_token`` and a decoded message's token fields agree"""
    token = is_token(value)
    assert token == (0 < len(value) <= MAX_TOKEN and set(value) <= set(TOKEN_CHARS))
    if token:
        assert check_token(value) == value
    else:
        with pytest.raises(SchemaError, match=re.escape(TOKEN_RULE)):
            check_token(value)
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    raw = msgspec.msgpack.encode(
        {"kind": TARDIS_STATE, "site": value, "drone": "d", "state": "UpState", "at": at}
    )
    if token:
        assert decode_note(raw).site == value
    else:
        with pytest.raises(SchemaError, match="site"):
            decode_note(raw)


def test_the_registry_and_the_config_refuse_the_same_retention() -> None:
    """``retain_lost_s``: ``0`` or at least :func:`least_retain_lost_s`, in both places"""
    lost, removal = 90.0, 3600.0
    shortest = least_retain_lost_s(lost, removal)
    assert shortest == removal
    with pytest.raises(ConfigError, match="retain_lost_s"):
        BusConfig.from_mapping(
            {
                "servers": "nats://h:4222",
                "lost_after_s": lost,
                "lost_removal_after_s": removal,
                "retain_lost_s": shortest - 1,
            }
        )
    config = BusConfig.from_mapping(
        {
            "servers": "nats://h:4222",
            "lost_after_s": lost,
            "lost_removal_after_s": removal,
            "retain_lost_s": shortest,
        }
    )
    assert config.retain_lost_s == shortest
    with pytest.raises(ValueError, match="retain_lost_s must be 0"):
        Registry(lost_after_s=lost, retain_lost_s=least_retain_lost_s(lost) - 1)
    assert Registry(lost_after_s=lost, retain_lost_s=least_retain_lost_s(lost)) is not None
    assert Registry(lost_after_s=lost, retain_lost_s=0) is not None
