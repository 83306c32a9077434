"""
deploy/htcondor/: every command the drone's startd configuration names exists,
and its knobs are the ones the agent's code uses
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.cli import build_parser
from broker.emulation.execution_point import DEPLOY_CONFIG, DEPLOY_DIR
from broker.emulation.execution_point import classad as emu
from broker.emulation.execution_point.config import Config
from remote_agent.gate.paths import GATE_ENV, PYTHON_ENV
from remote_agent.hooks import HOOK_KEYWORD
from remote_agent.htcondor import GATE_ATTRIBUTE
from remote_agent.interfaces import AGENT_UNREACHABLE_STATUS


@pytest.fixture
def config() -> Config:
    """The shipped configuration, with the hooks installed where they are in this checkout"""
    cfg = Config(environ={})
    cfg.set("START", "True")  # what a site's execution-point configuration may say
    cfg.read(DEPLOY_CONFIG)
    cfg.set("COBALD_REMOTE_LIBEXEC", str(DEPLOY_DIR))
    return cfg


def test_hook_keyword_is_forced_and_is_the_agents(config: Config) -> None:
    assert config.get("STARTER_JOB_HOOK_KEYWORD") == HOOK_KEYWORD


@pytest.mark.parametrize("hook", ["PREPARE_JOB", "JOB_EXIT"])
def test_every_hook_command_is_an_executable_file(config: Config, hook: str) -> None:
    path = Path(config.get(f"{HOOK_KEYWORD}_HOOK_{hook}") or "")
    assert path.is_absolute() and path.parent == DEPLOY_DIR
    assert path.is_file() and os.access(path, os.X_OK)
    # JOB_EXIT has no _ARGS knob: the wrapper must be a single executable path
    assert " " not in str(path)


def test_job_exit_timeout_is_a_number(config: Config) -> None:
    assert config.get_int(f"{HOOK_KEYWORD}_HOOK_JOB_EXIT_TIMEOUT", -1) > 0


def _start(config: Config, **attrs: emu.Value) -> emu.Value:
    slot = {name: emu.literal(value) for name, value in attrs.items()}
    return emu.evaluate(config.get("START") or "", slot)


def test_start_requires_the_agents_gate_attribute(config: Config) -> None:
    assert GATE_ATTRIBUTE in (config.get("START") or "")
    assert _start(config) is False  # undefined until the agent opens the gate: closed
    assert _start(config, **{GATE_ATTRIBUTE: False}) is False
    assert _start(config, **{GATE_ATTRIBUTE: True}) is True


def test_start_keeps_the_sites_own_start(config: Config) -> None:
    cfg = Config(environ={})
    cfg.set("START", "Memory > 4096")
    cfg.read(DEPLOY_CONFIG)
    assert _start(cfg, **{GATE_ATTRIBUTE: True, "Memory": 2048}) is False
    assert _start(cfg, **{GATE_ATTRIBUTE: True, "Memory": 8192}) is True
    assert _start(config, **{GATE_ATTRIBUTE: True}) is True


def test_graceful_drains_let_payloads_retire(config: Config) -> None:
    value = emu.evaluate(config.get("MAXJOBRETIREMENTTIME") or "0", {})
    assert isinstance(value, int) and value >= 7 * 24 * 3600


def test_master_exits_once_the_startd_is_gone(config: Config) -> None:
    expr = config.get("DAEMON_SHUTDOWN", subsystem="MASTER") or ""
    assert emu.evaluate(expr, {"STARTD_StartTime": emu.literal(0)}) is True
    assert emu.evaluate(expr, {"STARTD_StartTime": emu.literal(1_700_000_000)}) is False
    # only the master: a startd-wide DAEMON_SHUTDOWN would end the startd itself
    assert config.get("DAEMON_SHUTDOWN") is None


def test_prepare_job_wrapper_refuses_with_the_agents_code() -> None:
    text = (DEPLOY_DIR / "hook-prepare-job").read_text()
    assert "-m remote_agent.hooks prepare-job" in text
    assert f"HookStatusCode = {AGENT_UNREACHABLE_STATUS}" in text
    assert f"${{{PYTHON_ENV}:-python3}}" in text
    exit_text = (DEPLOY_DIR / "hook-job-exit").read_text()
    assert "-m remote_agent.hooks job-exit" in exit_text


def _hook_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (GATE_ENV, PYTHON_ENV)}
    return {**env, PYTHON_ENV: sys.executable, **extra}


def test_prepare_job_wrapper_runs_the_module_entry_point(tmp_path: Path) -> None:
    # no agent at that path: the hook itself answers 391 and exits 0
    done = subprocess.run(
        [DEPLOY_DIR / "hook-prepare-job"],
        input=b"ClusterId = 1\nProcId = 0\n",
        capture_output=True,
        env=_hook_env(**{GATE_ENV: str(tmp_path / "nobody.sock")}),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stdout.decode().splitlines()[0] == f"HookStatusCode = {AGENT_UNREACHABLE_STATUS}"
    assert b"unreachable" in done.stdout


def test_prepare_job_wrapper_refuses_benignly_when_python_fails(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: remote_agent' >&2\nexit 1\n")
    broken.chmod(0o755)
    done = subprocess.run(
        [DEPLOY_DIR / "hook-prepare-job"],
        input=b"ClusterId = 1\nProcId = 0\n",
        capture_output=True,
        env={**_hook_env(), PYTHON_ENV: str(broken)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0  # never a hold
    lines = done.stdout.decode().splitlines()
    assert lines[0] == f"HookStatusCode = {AGENT_UNREACHABLE_STATUS}"
    assert lines[1].startswith('HookStatusMessage = "cobald-remote hook failed (exit 1)')


def test_job_exit_wrapper_always_exits_zero(tmp_path: Path) -> None:
    done = subprocess.run(
        [DEPLOY_DIR / "hook-job-exit", "exit"],
        input=b"ClusterId = 1\nProcId = 0\nExitCode = 0\n",
        capture_output=True,
        env=_hook_env(**{GATE_ENV: str(tmp_path / "nobody.sock")}),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stdout == b""


@pytest.mark.parametrize(
    "argv",
    [
        ["agent", "hook", "prepare-job"],
        ["agent", "hook", "prepare-job", "--timeout", "2", "--socket", "/x.sock"],
        ["agent", "hook", "job-exit", "evict"],
    ],
)
def test_the_cobald_remote_hook_commands_exist(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert callable(args.run)
