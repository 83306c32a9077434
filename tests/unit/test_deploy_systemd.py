"""deploy/systemd: the units verify, start what the install provides, are hardened"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from remote_agent.deploy_files import DEPLOY_DIR

SYSTEMD = DEPLOY_DIR / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
# the documented install: a venv at this prefix (docs/deployment.md, "Running as services")
BIN = "/opt/cobald-remote/bin/"
EXPOSURE = 2.0  # systemd-analyze security: at most this ("OK"); the docs print each figure

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def _settings(unit: Path, key: str) -> list[str]:
    prefix = f"{key}="
    return [
        line.removeprefix(prefix)
        for line in unit.read_text().splitlines()
        if line.startswith(prefix)
    ]


def test_there_are_units() -> None:
    assert {p.name for p in UNITS} >= {
        "cobald-remote-nats.service",
        "cobald-remote-nats@.service",
        "cobald-remote-nats-leaf.service",
        "cobald-remote-manager.service",
    }


@needs_systemd
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_verifies_against_this_install(unit: Path, tmp_path: Path) -> None:
    # the venv's scripts directory replaced by this install's: verify then checks that every
    # command the unit starts is one the install put there
    text = unit.read_text()
    assert BIN in text
    copy = tmp_path / unit.name
    copy.write_text(text.replace(BIN, sysconfig.get_path("scripts") + "/"))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


@needs_systemd
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_is_hardened(unit: Path) -> None:
    threshold = f"--threshold={EXPOSURE * 10:.0f}"  # in tenths
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", threshold, str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-400:] + result.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_runs_as_a_user_the_sysusers_file_makes(unit: Path) -> None:
    sysusers = (SYSTEMD / "cobald-remote-sysusers.conf").read_text().splitlines()
    users = {line.split()[1] for line in sysusers if line.startswith("u ")}
    (user,) = _settings(unit, "User")
    assert user in users and _settings(unit, "Group") == [user]


def test_the_manager_unit_stops_cobald_with_sigint() -> None:
    # docs/tardis.md: SIGINT gives COBalD's clean exit
    assert _settings(SYSTEMD / "cobald-remote-manager.service", "KillSignal") == ["SIGINT"]
    assert "(`KillSignal=SIGINT`)" in (Path(__file__).parents[2] / "docs" / "tardis.md").read_text()
