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
from broker.cli import build_parser, main
from broker.commands.broker import default_store_dir
from broker.commands.options import ALL_ENV, SERVER_ENV, from_env
from remote_agent.deploy_files import DEPLOY_DIR
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


@pytest.mark.parametrize(
    ("argv", "server"),
    [
        (["--server", "nats://before:1", "status"], "nats://before:1"),
        (["status", "--server", "nats://after:1"], "nats://after:1"),
        (["--server", "nats://before:1", "status", "--server", "nats://after:1"], "nats://after:1"),
        (
            ["--server", "nats://top:1", "broker", "--server", "nats://group:1", "init"],
            "nats://group:1",
        ),
        (
            ["broker", "--server", "nats://group:1", "init", "--server", "nats://after:1"],
            "nats://after:1",
        ),
        (["auth", "revoke-bootstrapped", "s1-x"], "nats://own:4222"),
    ],
)
def test_the_bus_options_go_before_or_after_the_command_and_after_wins(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], server: str
) -> None:
    monkeypatch.setenv("COBALD_REMOTE_URL", "nats://own:4222")
    monkeypatch.setenv("NATS_URL", "nats://nats:4222")
    monkeypatch.setenv("COBALD_REMOTE_PREFIX", "env-prefix")
    args = build_parser().parse_args(argv)
    assert args.server == server
    assert args.prefix == "env-prefix"  # not given anywhere: the variable still
    given = ["--creds", "c.creds", "--domain", "hub", "--prefix", "p"]
    args = build_parser().parse_args([*given, "timeline", "s1-x", "--prefix", "q"])
    assert (args.creds, args.domain, args.prefix) == ("c.creds", "hub", "q")


def test_a_server_before_the_command_is_enough_and_the_parser_forgets_it() -> None:
    parser = build_parser()
    assert parser.parse_args(["--server", "nats://x:1", "broker", "init"]).server == "nats://x:1"
    assert parser.parse_args(["--prefix", "p", "broker", "serve"]).prefix == "p"
    with pytest.raises(SystemExit):  # the same parser: --server is required again
        parser.parse_args(["broker", "init"])


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--server", "nats://x:1", "deploy", "list"], "deploy list takes no --server"),
        (
            ["--prefix", "p", "--creds", "c", "check-config", "f"],
            "check-config takes no --creds or --prefix",
        ),
        (["broker", "--server", "nats://x:1", "serve"], "broker serve takes no --server"),
        (["--creds", "c", "agent", "run", "--", "true"], "agent run takes no --creds"),
        (
            ["agent", "hook", "--server", "nats://x:1", "job-exit"],
            "agent hook job-exit takes no --server",
        ),
        (
            ["--domain", "hub", "auth", "drone", "s1-x", "--authority", "a"],
            "auth drone takes no --domain",
        ),
    ],
)
def test_a_bus_option_before_a_command_that_takes_none_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {line} before its name")


def test_the_store_default_is_named_in_the_help_not_resolved(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # no line breaks inside the path
    with pytest.raises(SystemExit):
        main(["broker", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert str(tmp_path) not in text
    assert "$XDG_DATA_HOME/cobald-remote/nats, else ~/.local/share/cobald-remote/nats" in text
    assert default_store_dir() == tmp_path / ".local" / "share" / "cobald-remote" / "nats"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_store_dir() == tmp_path / "data" / "cobald-remote" / "nats"


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
    config = DEPLOY_DIR / "cobald" / "htcondor.yaml"
    done = _cli("check-config", "--json", str(config))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["valid"], report["problems"]) == (True, [])
    (factory,) = report["factories"]
    assert (factory["where"], factory["form"]) == ("pipeline[3]", "!RemoteTardisPoolFactory")
    assert factory["bus"]["domain"] == "hub"
    assert factory["bus"]["drone_servers"] == ["nats://nats-leaf.site.example.org:4222"]
