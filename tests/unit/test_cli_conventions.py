"""The command line's conventions: the environment's NATS settings, global options, --version"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import broker
import remote_agent
from broker.cli import build_parser
from broker.commands.options import ALL_ENV, SERVER_ENV, from_env
from remote_agent.protocol.names import DEFAULT_PREFIX
from remote_agent.settings import Settings

ROOT = Path(broker.__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_bus_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ALL_ENV}
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *argv],
        capture_output=True,
        cwd=ROOT,
        env=env,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", [["status"], ["broker", "init"], ["timeline", "s1-x"]])
def test_server_and_creds_default_to_the_nats_variables(
    monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://bus:4222")
    monkeypatch.setenv("NATS_CREDS", "/etc/manager.creds")
    args = build_parser().parse_args(command)
    assert (args.server, args.creds) == ("nats://bus:4222", "/etc/manager.creds")


def test_the_projects_variables_come_first_and_the_option_before_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://nats:4222")
    monkeypatch.setenv("COBALD_REMOTE_URL", "nats://own:4222")
    monkeypatch.setenv("COBALD_REMOTE_CREDS", "")  # empty: not set
    monkeypatch.setenv("NATS_CREDS", "nats.creds")
    args = build_parser().parse_args(["status"])
    assert (args.server, args.creds) == ("nats://own:4222", "nats.creds")
    args = build_parser().parse_args(["status", "--server", "nats://given:1", "--creds", "c"])
    assert (args.server, args.creds) == ("nats://given:1", "c")
    assert from_env(SERVER_ENV, {}) is None


@pytest.mark.parametrize(
    "command", [["status"], ["broker", "init"], ["timeline", "s1-x"], ["drain", "s1-x"]]
)
def test_prefix_and_domain_default_to_the_variables_the_agent_reads(
    monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    given = ["--server", "nats://bus:4222"]
    args = build_parser().parse_args([*command, *given])
    assert (args.prefix, args.domain) == (DEFAULT_PREFIX, None)
    env = {"COBALD_REMOTE_PREFIX": " site-a ", "COBALD_REMOTE_DOMAIN": "hub"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args([*command, *given])
    assert (args.prefix, args.domain) == ("site-a", "hub")
    drone = {"COBALD_REMOTE_DRONE": "s1-0123456789", "COBALD_REMOTE_URL": "nats://a"}
    agent = Settings.from_env({**env, **drone}, worker_command=["condor_master"])
    assert (agent.prefix, agent.domain) == (args.prefix, args.domain)  # the same variables
    args = build_parser().parse_args([*command, *given, "--prefix", "p", "--domain", "d"])
    assert (args.prefix, args.domain) == ("p", "d")


def test_the_help_names_the_variables() -> None:
    text = _cli("status", "--help").stdout
    assert "$COBALD_REMOTE_PREFIX, else cobald" in " ".join(text.split())
    assert "$COBALD_REMOTE_DOMAIN, else none" in " ".join(text.split())
    assert "$COBALD_REMOTE_PREFIX" in _cli("broker", "serve", "--help").stdout


def test_without_a_server_anywhere_the_command_is_a_usage_error() -> None:
    done = _cli("broker", "init")
    assert done.returncode == 2
    assert "--server" in done.stderr
    assert "$NATS_URL" in _cli("broker", "init", "--help").stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["-vv", "broker", "init"],
        ["broker", "init", "-vv"],
        ["-v", "broker", "init", "--verbose"],
        ["broker", "-v", "init", "-v"],
    ],
)
def test_verbosity_counts_before_and_after_the_command(argv: list[str]) -> None:
    done = _cli(*argv, "--server", "nats://127.0.0.1:1")
    assert done.returncode == 1
    assert "DEBUG cobald.runtime.cobald_remote.connection" in done.stderr


def test_one_v_is_info_and_none_is_quiet() -> None:
    quiet = _cli("broker", "init", "--server", "nats://127.0.0.1:1")
    info = _cli("broker", "init", "-v", "--server", "nats://127.0.0.1:1")
    assert quiet.stderr.startswith("cobald-remote: cannot connect")
    assert "DEBUG" not in info.stderr + quiet.stderr


def test_version_is_the_packages() -> None:
    done = _cli("--version")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"cobald-remote {remote_agent.__version__}\n"
    assert remote_agent.__version__ == importlib.metadata.version("cobald-remote")


#: the commands that print no result to script against: the agent (its log), the job hooks
#: (what HTCondor reads), ``deploy show`` (the file itself), ``protocol decode`` (JSON already)
_NO_JSON = {
    ("agent", "run"),
    ("agent", "hook", "prepare-job"),
    ("agent", "hook", "job-exit"),
    ("deploy", "show"),
    ("protocol", "decode"),
}


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [leaf for name, sub in subs[0].choices.items() for leaf in _leaves(sub, (*path, name))]


def test_every_command_that_prints_a_result_takes_json() -> None:
    missing = [
        " ".join(path)
        for path, parser in _leaves(build_parser())
        if path not in _NO_JSON
        and not any("--json" in action.option_strings for action in parser._actions)
    ]
    assert missing == []


def test_check_config_prints_its_report_as_json() -> None:
    config = ROOT / "remote_agent" / "deploy" / "cobald" / "htcondor.yaml"
    done = _cli("check-config", "--json", str(config))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["valid"], report["problems"]) == (True, [])
    (factory,) = report["factories"]
    assert (factory["where"], factory["form"]) == ("pipeline[3]", "!RemoteTardisPoolFactory")
    assert factory["bus"]["domain"] == "hub"
    assert factory["bus"]["drone_servers"] == ["nats://nats-leaf.site.example.org:4222"]
