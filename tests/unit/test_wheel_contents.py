"""A wheel built from the checkout carries every deployment file, scripts executable"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from remote_agent import deploy_files

ROOT = Path(deploy_files.__file__).resolve().parents[1]


def test_the_wheel_ships_the_deployment_files(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    for package in ("remote_agent", "broker"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("cobald_remote-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        modes = {
            info.filename.removeprefix("remote_agent/deploy/"): info.external_attr >> 16 & 0o777
            for info in archive.infolist()
            if info.filename.startswith("remote_agent/deploy/")
        }
    shipped = deploy_files.shipped()
    assert set(modes) == set(shipped)
    for name, path in shipped.items():
        assert bool(modes[name] & 0o111) == path.read_bytes().startswith(b"#!"), name
