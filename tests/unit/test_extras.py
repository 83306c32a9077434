"""The drone-side install without the manager extra: one line that names it, nothing broken"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from broker.commands.failures import EXIT_FAILURE, run

#: what COBalD does with the entry point for every YAML configuration, where TARDIS is missing
_COBALD_WITHOUT_TARDIS = """
import sys
sys.modules["tardis"] = None
from importlib.metadata import entry_points
(entry,) = entry_points(group="cobald.config.yaml_constructors", name="RemoteTardisPoolFactory")
tag = entry.load().s
print(sorted(m for m, v in sys.modules.items() if v and m.startswith(("tardis", "broker.tardis."))))
try:
    tag(interval=1)
except ImportError as err:
    print(type(err).__name__, err)
"""


def test_the_entry_point_loads_without_tardis_and_the_tag_names_the_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _COBALD_WITHOUT_TARDIS], capture_output=True, check=True, text=True
    )
    assert done.stdout.splitlines() == [
        "[]",
        "NeedsManager !RemoteTardisPoolFactory needs the manager install: "
        "pip install 'cobald-remote[manager]' (no module 'tardis' here)",
    ]


def _fails_with(err: Exception) -> argparse.Namespace:
    def handler(args: argparse.Namespace) -> int:
        raise err

    return argparse.Namespace(run=handler, group="check-config")


def test_a_missing_manager_module_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_fails_with(ModuleNotFoundError("no", name="cobald.daemon"))) == EXIT_FAILURE
    assert capsys.readouterr().err == (
        "cobald-remote: check-config needs the manager install: "
        "pip install 'cobald-remote[manager]' (no module 'cobald' here)\n"
    )


def test_any_other_missing_module_keeps_its_traceback() -> None:
    with pytest.raises(ModuleNotFoundError):
        run(_fails_with(ModuleNotFoundError("no", name="nats")))


def test_the_demo_without_tardis_names_the_extra_before_it_starts_anything() -> None:
    script = 'import sys; sys.modules["tardis"] = None\nfrom broker.cli import main\nmain(["demo"])'
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "")  # main returns the status, -c exits 0
    assert done.stderr == (
        "cobald-remote: demo needs the manager install: "
        "pip install 'cobald-remote[manager]' (no module 'tardis' here)\n"
    )
