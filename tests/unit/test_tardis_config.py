"""The ``bus:`` section: every key and default, and one line per problem naming its key"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ConfigError
from broker.tardis.config import (
    DEFAULT_RETAIN_ENDED_S,
    EXPECTED,
    BusConfig,
    creds_problem,
    decode_bus,
    site_problems,
    site_token,
)
from broker.tardis.pool import DEFAULT_DRONE_START_S
from remote_agent.errors import SettingsError
from remote_agent.settings import Settings

URL = "nats://a:4222"
SECONDS = "expected a number of seconds > 0 (at most 10 years)"


def test_every_key_and_its_default() -> None:
    config = BusConfig.from_mapping({"servers": URL})
    assert config == BusConfig(
        servers=(URL,),
        drone_servers=(URL,),
        creds=None,
        domain=None,
        prefix="cobald",
        durable="cobald-registry",
        lost_after_s=90.0,
        drain_deadline_s=86400.0,
        lost_removal_after_s=86400.0,
        request_timeout_s=2.0,
        retain_ended_s=DEFAULT_RETAIN_ENDED_S,
        drone_environment=True,
        note_buffer=10_000,
        metrics=None,
    )
    assert DEFAULT_RETAIN_ENDED_S == 86400.0
    # every field has its words in the error lines, and nothing else does
    assert set(EXPECTED) == set(BusConfig.__struct_fields__)


def test_the_forms_the_docs_show() -> None:
    config = BusConfig.from_mapping(
        {
            "servers": "nats://n1:4222, nats://n2:4222",
            "drone_servers": ["tls://leaf:4222"],
            "domain": "hub",
            "creds": "/etc/cobald-remote/manager.creds",
            "lost_after_s": 30,
            "drone_environment": False,
            "metrics": 9464,
            "retain_ended_s": 3600.5,
            "prefix": None,  # null: the default
        }
    )
    assert config.servers == ("nats://n1:4222", "nats://n2:4222")
    assert config.drone_servers == ("tls://leaf:4222",)
    assert (config.lost_after_s, config.retain_ended_s) == (30.0, 3600.5)
    assert config.retain_lost_s == 7 * 86400.0
    assert BusConfig.from_mapping({"servers": URL, "retain_lost_s": 0}).retain_lost_s == 0
    assert config.drone_environment is False
    assert config.metrics_address == ("127.0.0.1", 9464)
    assert config.prefix == "cobald"
    with pytest.raises(AttributeError):
        config.prefix = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("section", "line"),
    [
        ({}, "bus.servers: required, e.g. nats://nats.example.org:4222"),
        ("nats://a:4222", "bus: expected a mapping with at least 'servers', got 'nats://a:4222'"),
        ({1: URL}, "bus: every key must be a string"),
        ({"servers": URL, "lost_after_s": "abc"}, f"bus.lost_after_s: {SECONDS}, got 'abc'"),
        ({"servers": URL, "lost_after_s": -1}, f"bus.lost_after_s: {SECONDS}, got -1"),
        ({"servers": URL, "lost_after_s": True}, f"bus.lost_after_s: {SECONDS}, got True"),
        (
            {"servers": URL, "drain_deadline_s": float("inf")},
            f"bus.drain_deadline_s: {SECONDS}, got inf",
        ),
        (
            {"servers": URL, "request_timeout_s": float("nan")},
            f"bus.request_timeout_s: {SECONDS}, got nan",
        ),
        ({"servers": URL, "retain_ended_s": 0}, f"bus.retain_ended_s: {SECONDS}, got 0"),
        (
            {"servers": URL, "retain_lost_s": -1},
            "bus.retain_lost_s: expected 0 (never) or a number of seconds at least "
            "lost_after_s and lost_removal_after_s (at most 10 years), got -1",
        ),
        (
            {"servers": URL, "retain_lost_s": 3600},
            "bus.retain_lost_s: expected 0 (never) or a number of seconds at least "
            "lost_after_s and lost_removal_after_s (at most 10 years), got 3600 (86400 s here)",
        ),
        (
            {"servers": URL, "lost_removal_after_s": 30 * 86400},
            "bus.retain_lost_s: expected 0 (never) or a number of seconds at least "
            "lost_after_s and lost_removal_after_s (at most 10 years), got 604800.0 "
            "(2592000 s here)",
        ),
        (
            {"servers": URL, "drone_environment": "no"},
            "bus.drone_environment: expected true or false, got 'no'",
        ),
        (
            {"servers": URL, "drone_environment": 1},
            "bus.drone_environment: expected true or false, got 1",
        ),
        (
            {"servers": URL, "note_buffer": 2.5},
            "bus.note_buffer: expected a whole number > 0, got 2.5",
        ),
        ({"servers": URL, "note_buffer": 0}, "bus.note_buffer: expected a whole number > 0, got 0"),
        (
            {"servers": URL, "black_hole_drones": -1},
            "bus.black_hole_drones: expected a whole number >= 0 (0: off), got -1",
        ),
        (
            {"servers": URL, "black_hole_lifetime_s": 0},
            f"bus.black_hole_lifetime_s: {SECONDS}, got 0",
        ),
        (
            {"servers": URL, "black_hole_backoff_max_s": 60},
            "bus.black_hole_backoff_max_s: expected a number of seconds at least "
            "black_hole_backoff_s (at most 10 years), got 60 (300 s here)",
        ),
        (
            {"servers": URL, "lost_after": 3},
            "bus.lost_after: unknown key (known: " + ", ".join(EXPECTED) + ")",
        ),
        (
            {"servers": URL, "prefix": "a.b"},
            "bus.prefix: expected a subject token (1-128 of A-Z a-z 0-9 _ - "
            "(no dots, wildcards or whitespace)), got 'a.b'",
        ),
        ({"servers": URL, "durable": "x y"}, "bus.durable: expected a consumer name"),
        ({"servers": URL, "domain": "hub.x"}, "bus.domain: expected a JetStream domain"),
        (
            {"servers": URL, "creds": 7},
            "bus.creds: expected the path of the manager's NATS credentials file, got 7",
        ),
        (
            {"servers": URL, "metrics": "nowhere"},
            "bus.metrics: expected host:port (e.g. 127.0.0.1:9464), or a port on loopback, got "
            "'nowhere' (metrics address 'nowhere' is not host:port (e.g. 127.0.0.1:9464))",
        ),
        ({"servers": URL, "metrics": "h:70000"}, "(metrics port 70000 is outside 0-65535)"),
    ],
)
def test_each_problem_is_one_line_naming_its_key(section: Any, line: str) -> None:
    config, problems = decode_bus(section)
    assert config is None
    [problem] = problems
    assert problem.startswith(line) if not line.startswith("(") else problem.endswith(line)
    assert "\n" not in problem


@pytest.mark.parametrize(
    ("servers", "why"),
    [
        ("http://a:4222", ""),
        ([], ""),
        ("", ""),
        (5, ""),
        (["nats://a:4222", 5], ""),
        ("nats://", ""),
        ("nats://a:port", ""),
        ("nats://a:4222,ws://b:80", " (ws:// or wss:// URLs mixed with nats:// or tls:// ones)"),
    ],
)
def test_urls_are_what_the_agent_accepts(servers: Any, why: str) -> None:
    _, problems = decode_bus({"servers": servers})
    assert problems == [f"bus.servers: expected {EXPECTED['servers']}, got {servers!r}{why}"]
    assert "nats://, tls://, ws://, wss://HOST:PORT" in problems[0]
    _, problems = decode_bus({"servers": URL, "drone_servers": servers})
    if servers:  # an empty drone_servers means servers
        assert problems[0].startswith("bus.drone_servers: expected NATS URLs")
    if isinstance(servers, str) and servers:
        # one rule: the agent refuses the same URLs
        env = {"TardisDroneUuid": "site1-0123456789", "COBALD_REMOTE_URL": servers}
        with pytest.raises(SettingsError, match="broker URLs: "):
            Settings.from_env(env, worker_command=["true"])


def test_every_problem_at_once_and_as_the_exception() -> None:
    section = {
        "servers": "http://a:1",
        "lost_after_s": "abc",
        "drone_environment": "no",
        "bogus": 1,
    }
    with pytest.raises(ConfigError) as raised:
        BusConfig.from_mapping(section)
    keys = [line.split(":", 1)[0] for line in raised.value.problems]
    assert sorted(keys) == ["bus.bogus", "bus.drone_environment", "bus.lost_after_s", "bus.servers"]
    assert str(raised.value) == "; ".join(raised.value.problems)
    assert isinstance(raised.value, ValueError)  # what TARDIS-side callers catch
    _, problems = decode_bus({"lost_after_s": "abc"})  # missing servers does not hide the rest
    assert problems == [
        f"bus.lost_after_s: {SECONDS}, got 'abc'",
        "bus.servers: required, e.g. nats://nats.example.org:4222",
    ]


def test_site_names_become_subject_tokens() -> None:
    assert site_token("MySite") == "mysite"
    with pytest.raises(ValueError, match="site name"):
        site_token("my site")
    assert site_problems(["MySite", "Other_1"]) == []
    [line] = site_problems(["my.site"])
    assert line.startswith("tardis.Sites: site name 'my.site' in lower case is not a subject token")


def test_the_credentials_file_says_what_to_do(tmp_path: Path) -> None:
    creds = tmp_path / "manager.creds"
    missing = creds_problem(str(creds))
    assert missing is not None and "does not exist" in missing
    assert "cobald-remote auth manager" in missing
    creds.write_text("creds")
    assert creds_problem(str(creds)) is None
    if os.getuid() != 0:  # root reads it anyway
        creds.chmod(0)
        unreadable = creds_problem(str(creds))
        assert unreadable is not None and f"not readable by uid {os.getuid()}" in unreadable
        assert "let the user that runs COBalD read it" in unreadable
    directory = creds_problem(str(tmp_path))
    assert directory is not None and directory.startswith(f"bus.creds: cannot read {tmp_path}")


def test_the_manager_gets_every_timing_of_the_section() -> None:
    config = BusConfig.from_mapping(
        {"servers": "nats://a:4222", "lost_after_s": 60, "retain_ended_s": 3600}
    )
    settings = config.manager_settings()
    assert (settings.lost_after_s, settings.retain_ended_s) == (60.0, 3600.0)


def test_check_config_warns_of_a_slurm_site_with_several_drone_urls() -> None:
    from broker.tardis.check import Site, slurm_warnings

    slurm = Site("MySlurm", "Slurm", "-1", ("m",), "myslurm")
    condor = Site("MyCondor", "HTCondor", "-1", ("m",), "mycondor")
    two = BusConfig.from_mapping({"servers": URL, "drone_servers": f"{URL},nats://b:4222"})
    [line] = slurm_warnings(two, [slurm, condor])
    assert "MySlurm" in line and "only the first" in line and URL in line
    assert slurm_warnings(BusConfig.from_mapping({"servers": URL}), [slurm]) == []


def test_bootstrap_creds_without_the_issuer_key_is_a_problem(tmp_path: Path) -> None:
    from broker.tardis.check import bootstrap_warnings

    config, problems = decode_bus({"servers": URL, "bootstrap_creds": "/etc/x.creds"})
    assert config is None
    assert any("bus.bootstrap_creds: set without bus.bootstrap_key" in p for p in problems)
    missing = BusConfig.from_mapping({"servers": URL, "bootstrap_key": str(tmp_path / "no")})
    warnings = bootstrap_warnings(missing)
    assert any("bus.bootstrap_key:" in w and "cannot issue" in w for w in warnings)
    assert any("bus.bootstrap_creds: not set" in w for w in warnings)


def test_the_black_hole_keys_make_the_detectors_rules() -> None:
    rules = BusConfig.from_mapping(
        {
            "servers": URL,
            "black_hole_drones": 5,
            "black_hole_lifetime_s": 1200,
            "black_hole_backoff_s": 60,
            "black_hole_backoff_max_s": 60,
        }
    ).black_hole_rules()
    assert (rules.drones, rules.lifetime_s, rules.backoff_s, rules.backoff_max_s) == (
        5,
        1200.0,
        60.0,
        60.0,
    )
    assert (
        BusConfig.from_mapping({"servers": URL, "black_hole_drones": 0}).black_hole_rules().drones
        == 0
    )


def test_a_new_drones_start_is_a_span_with_a_default() -> None:
    assert BusConfig.from_mapping({"servers": URL}).drone_start_s == DEFAULT_DRONE_START_S
    assert BusConfig.from_mapping({"servers": URL, "drone_start_s": 120}).drone_start_s == 120.0
    with pytest.raises(ConfigError) as refused:
        BusConfig.from_mapping({"servers": URL, "drone_start_s": 0})
    assert str(refused.value) == (
        "bus.drone_start_s: expected a number of seconds > 0 (at most 10 years), got 0"
    )
