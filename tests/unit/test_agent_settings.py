"""The agent's configuration: identity from TARDIS, options over environment over defaults"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from broker.cli import build_parser
from remote_agent.errors import SettingsError
from remote_agent.jobruntime import format_attributes
from remote_agent.logs import JsonLines
from remote_agent.options import from_args
from remote_agent.protocol.environment import NATS_TOOL_ENV, TARDIS_SETTINGS_ENV
from remote_agent.settings import SETTINGS_ENV, Settings, default_gate_socket, field_default

UUID = "site1-0123456789"
BASE = {"TardisDroneUuid": UUID, "COBALD_REMOTE_URL": "nats://127.0.0.1:4222"}
WORKER = ["condor_master", "-f"]


def test_identity_and_site_from_the_tardis_uuid(tmp_path: Path) -> None:
    env = {**BASE, "_CONDOR_SCRATCH_DIR": str(tmp_path)}
    settings = Settings.from_env(env, worker_command=WORKER)
    assert (settings.site, settings.drone) == ("site1", UUID)
    assert settings.servers == ("nats://127.0.0.1:4222",)
    assert settings.worker_command == ("condor_master", "-f")
    assert settings.spool_dir == tmp_path / f"cobald-remote-{UUID}"
    assert settings.gate_socket == settings.spool_dir / "gate.sock"
    assert (settings.heartbeat_s, settings.deadline_policy, settings.startd) == (30.0, "wait", True)
    assert settings.prefix == "cobald" and settings.creds is None


@pytest.mark.parametrize(
    ("env", "slots"),
    [
        ({}, 0),
        ({"TardisDroneCores": "8"}, 8),
        ({"TardisDroneCores": "4.0"}, 4),
        ({"TardisDroneCores": "x"}, 0),
        ({"TardisDroneCores": "8", "COBALD_REMOTE_SLOTS": "2"}, 2),
    ],
)
def test_slots_come_from_the_drones_cores(env: dict[str, str], slots: int) -> None:
    assert Settings.from_env({**BASE, **env}, worker_command=WORKER).slots == slots


def test_a_site_with_dashes_keeps_them() -> None:
    env = {**BASE, "TardisDroneUuid": "kit-cloud-abcdef0123"}
    assert Settings.from_env(env, worker_command=WORKER).site == "kit-cloud"


def test_explicit_values_win(tmp_path: Path) -> None:
    env = {
        **BASE,
        "COBALD_REMOTE_DRONE": "wn042",
        "COBALD_REMOTE_SITE": "other",
        "COBALD_REMOTE_URL": "nats://a:4222, nats://b:4222",
        "COBALD_REMOTE_HEARTBEAT_S": "5",
        "COBALD_REMOTE_DEADLINE_POLICY": "kill",
        "COBALD_REMOTE_STARTD": "no",
        "TMPDIR": str(tmp_path),
    }
    settings = Settings.from_env(env, worker_command=WORKER)
    assert (settings.drone, settings.site) == ("wn042", "other")
    assert settings.servers == ("nats://a:4222", "nats://b:4222")
    assert (settings.heartbeat_s, settings.deadline_policy, settings.startd) == (5.0, "kill", False)
    assert settings.spool_dir == tmp_path / "cobald-remote-wn042"
    # options over the environment
    settings = Settings.from_env(env, worker_command=WORKER, site="third", heartbeat_s=1.5)
    assert (settings.site, settings.heartbeat_s) == ("third", 1.5)


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"COBALD_REMOTE_URL": "nats://x:1"}, "no drone identity"),
        ({**BASE, "TardisDroneUuid": "wn042"}, "no site for drone 'wn042'"),
        ({"TardisDroneUuid": UUID}, "no broker URL"),
        ({**BASE, "COBALD_REMOTE_URL": "http://x:1"}, "is not one of nats, tls, ws, wss"),
        ({**BASE, "COBALD_REMOTE_HEARTBEAT_S": "soon"}, "invalid COBALD_REMOTE_HEARTBEAT_S='soon'"),
        ({**BASE, "COBALD_REMOTE_HEARTBEAT_S": "0"}, "heartbeat_s must be a finite positive"),
        ({**BASE, "COBALD_REMOTE_HEARTBEAT_S": "inf"}, "heartbeat_s must be a finite positive"),
        ({**BASE, "COBALD_REMOTE_HEARTBEAT_S": "nan"}, "heartbeat_s must be a finite positive"),
        ({**BASE, "COBALD_REMOTE_END_GRACE_S": "inf"}, "end_grace_s must be a finite number"),
        ({**BASE, "COBALD_REMOTE_DEADLINE_POLICY": "maybe"}, "must be 'wait' or 'kill'"),
        ({**BASE, "COBALD_REMOTE_STARTD": "perhaps"}, "expected true/false"),
        ({**BASE, "COBALD_REMOTE_SITE": "a.b"}, "invalid site 'a.b'"),
        ({**BASE, "COBALD_REMOTE_CREDS": "/nonexistent.creds"}, "does not exist"),
        ({**BASE, "COBALD_REMOTE_SPOOL_MAX_EVENTS": "3"}, "at least 10"),
    ],
)
def test_bad_configuration_is_a_clear_error(env: dict[str, str], error: str) -> None:
    with pytest.raises(SettingsError, match=error.replace("(", r"\(").replace(".", r"\.")):
        Settings.from_env(env, worker_command=WORKER)


def test_a_worker_command_is_required() -> None:
    with pytest.raises(SettingsError, match="no worker command"):
        Settings.from_env(BASE)


def test_a_long_spool_path_gets_a_short_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    socket = default_gate_socket(deep)
    assert socket.parent != deep and len(str(socket)) < 108


def test_the_command_line(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "agent",
            "run",
            "--url",
            "nats://a:1",
            "--url",
            "nats://b:2,nats://c:3",
            "--no-startd",
            "--heartbeat",
            "2",
            "--spool-dir",
            str(tmp_path),
            "--",
            "sleep",
            "--flag",
        ]
    )
    settings = from_args(args, env={"TardisDroneUuid": UUID})
    assert settings.servers == ("nats://a:1", "nats://b:2", "nats://c:3")
    assert settings.worker_command == ("sleep", "--flag")
    assert (settings.startd, settings.heartbeat_s, settings.spool_dir) == (False, 2.0, tmp_path)
    # without --no-startd the environment decides, by default: a startd
    args = build_parser().parse_args(["agent", "run", "--url", "nats://a:1", "--", "x"])
    assert from_args(args, env={"TardisDroneUuid": UUID}).startd is True


def test_json_lines_carry_the_extras() -> None:
    record = logging.LogRecord("agent", logging.INFO, "", 0, "%s done", ("drain",), None)
    record.drone = UUID
    line = json.loads(JsonLines().format(record))
    assert line["message"] == "drain done" and line["drone"] == UUID
    assert line["level"] == "INFO" and line["at"].endswith("+00:00")


def test_domain_from_option_environment_or_tardis(tmp_path: Path) -> None:
    def domain(env: dict[str, str], *options: str) -> str | None:
        args = build_parser().parse_args(["agent", "run", *options, "--", "x"])
        return from_args(args, env={**BASE, "_CONDOR_SCRATCH_DIR": str(tmp_path), **env}).domain

    assert domain({}) is None
    assert domain({"TardisDroneCobaldRemoteDomain": "hub"}) == "hub"
    both = {"TardisDroneCobaldRemoteDomain": "hub", "COBALD_REMOTE_DOMAIN": "central"}
    assert domain(both) == "central"
    assert domain(both, "--domain", "other") == "other"
    with pytest.raises(SettingsError, match="JetStream domain"):
        domain({"COBALD_REMOTE_DOMAIN": "no.dots"})


def test_the_documented_defaults_are_the_settings_defaults() -> None:
    """docs/agent.md's table of options: each default as :mod:`remote_agent.settings` has it"""
    text = (Path(__file__).resolve().parents[2] / "docs" / "agent.md").read_text()
    table = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    by_env = {env: name for name, env in SETTINGS_ENV.items()}
    checked = set()
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) != 4 or not cells[1].startswith("`COBALD_REMOTE_"):
            continue
        name = by_env.get(cells[1].split("`")[1])
        default = field_default(name) if name else None
        if isinstance(default, bool) or not isinstance(default, int | float | str | tuple):
            continue
        if isinstance(default, tuple):
            expected = f"`{format_attributes(default)}`"
        elif isinstance(default, str):
            expected = f"`{default}`"
        else:
            expected = f"{default:g}"
        assert cells[2] == expected, (name, cells[2])
        checked.add(name)
    assert {"heartbeat_s", "end_margin_s", "term_grace_s", "runtime_attributes"} <= checked


def test_every_variable_the_agent_reads_is_documented() -> None:
    """docs/agent.md's table names each variable, the TARDIS and nats-tool fallbacks too"""
    text = (Path(__file__).resolve().parents[2] / "docs" / "agent.md").read_text()
    table = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([A-Za-z_]+)(?:=[^`]*)?`", table))
    read = {*SETTINGS_ENV.values(), *TARDIS_SETTINGS_ENV.values(), *NATS_TOOL_ENV.values()}
    assert read - named == set()
    assert "`--slots`" in table
    assert "`--server`" in table and "`--url` is the same" in table


def test_the_agent_takes_server_and_the_nats_tools_variables(tmp_path: Path) -> None:
    creds = tmp_path / "drone.creds"
    creds.write_text("")
    env = {"TardisDroneUuid": "site1-0123456789", "NATS_URL": "nats://n:4222"}
    settings = Settings.from_env({**env, "NATS_CREDS": str(creds)}, worker_command=("x",))
    assert (settings.servers, settings.creds) == (("nats://n:4222",), creds)
    tardis = {**env, "TardisDroneCobaldRemoteUrl": "nats://t:4222"}
    assert Settings.from_env(tardis, worker_command=("x",)).servers == ("nats://t:4222",)
    for flag in ("--server", "--url"):
        args = build_parser().parse_args(["agent", "run", flag, "nats://a:1", "--", "x"])
        assert args.servers == ["nats://a:1"]
