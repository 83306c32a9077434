"""The drone's ``cobald-remote agent run`` loads none of the central side's code"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import broker

#: what a drone never needs: the manager, the server side, JetStream, TARDIS and COBalD
CENTRAL = ("broker.manager", "broker.tardis", "broker.jetstream", "broker.server")
THIRD_PARTY = ("tardis", "cobald")

_PROBE = """
import json, sys
from broker.cli import main
try:
    code = main({argv!r})
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""


def _loaded(argv: list[str]) -> tuple[object, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COBALD_REMOTE_", "Tardis"))}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=argv)],
        capture_output=True,
        check=True,
        cwd=Path(broker.__file__).resolve().parent.parent,
        env=env,
        text=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    return result["code"], result["modules"]


def _central(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(CENTRAL) or m.split(".")[0] in THIRD_PARTY]


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["agent", "run", "--help"], 0),
        (["agent", "run", "--url", "nats://127.0.0.1:1", "--", "true"], 2),  # no drone uuid
    ],
)
def test_agent_run_loads_nothing_of_the_central_side(argv: list[str], code: int) -> None:
    got, modules = _loaded(argv)
    assert got == code
    assert _central(modules) == []
    assert "broker.commands.ops" in modules  # the probe saw the whole command line


def test_a_central_command_loads_its_part() -> None:
    _, modules = _loaded(["status", "--help"])
    assert "broker.manager.registry" in modules
    assert "tardis" not in modules
