"""What the fake ``condor_*`` tools share: output, configuration, asking the master"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from broker.emulation.errors import ConfigError, EmulatorUnavailable
from broker.emulation.execution_point.config import Config
from broker.emulation.execution_point.paths import control_socket_path
from broker.emulation.rpc import request_sync


def print_err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def print_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def state_dir_of(config: Config) -> Path:
    return Path(config.get("EMULATOR_STATE_DIR") or config.get("LOCAL_DIR") or ".")


def ask_master(config: Config, op: str, **fields: Any) -> dict[str, Any] | None:
    """The master's reply, or ``None`` if no emulated master runs"""
    path = control_socket_path(state_dir_of(config))
    if not path.exists():
        return None
    try:
        return request_sync(path, {"op": op, **fields})
    except EmulatorUnavailable:
        return None


def load_config(tool: str) -> Config | None:
    try:
        return Config.from_environment()
    except ConfigError as err:
        print_err(f"{tool} (emulated): {err}\n")
        return None


def is_dash_arg_prefix(arg: str, name: str, min_len: int) -> bool:
    """HTCondor's ``is_dash_arg_prefix``: ``-abbrev`` of ``name``, at least ``min_len`` long"""
    if not arg.startswith("-"):
        return False
    body = arg[2:] if arg.startswith("--") else arg[1:]
    if not body or not name.startswith(body):
        return False
    return len(body) >= (len(name) if min_len < 0 else min_len)
