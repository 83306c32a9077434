"""
A wheel built from the checkout carries every deployment file, scripts executable

The repository keeps them in the top-level ``deploy/``; the wheel carries them
inside the package, as ``remote_agent/deploy/``, where
:data:`remote_agent.deploy_files.DEPLOY_DIR` finds them in an install.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from remote_agent import deploy_files

ROOT = Path(deploy_files.__file__).resolve().parents[1]
#: where the wheel carries the repository's deploy/
IN_WHEEL = "remote_agent/deploy/"


def test_the_wheel_ships_the_deployment_files(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    for directory in ("remote_agent", "broker", "deploy"):
        shutil.copytree(
            ROOT / directory, source / directory, ignore=shutil.ignore_patterns("__pycache__")
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
        names = archive.namelist()
        modes = {
            info.filename.removeprefix(IN_WHEEL): info.external_attr >> 16 & 0o777
            for info in archive.infolist()
            if info.filename.startswith(IN_WHEEL)
        }
    shipped = deploy_files.shipped()
    assert set(modes) == set(shipped)
    for name, path in shipped.items():
        assert bool(modes[name] & 0o111) == path.read_bytes().startswith(b"#!"), name
    # the repository's layout stays out of the install: no top-level deploy/
    assert not [name for name in names if name.startswith("deploy/")]


def test_the_checkout_finds_the_files_in_the_top_level_deploy() -> None:
    assert deploy_files.DEPLOY_DIR == ROOT / "deploy"
    assert not (ROOT / "remote_agent" / "deploy").exists()


def _packages_in_checkout() -> set[str]:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("remote_agent", "broker")
        for init in (ROOT / top).rglob("__init__.py")
    }
    groups = {
        f"remote_agent.deploy.{group.name}"
        for group in (ROOT / "deploy").iterdir()
        if group.is_dir() and not group.name.startswith((".", "_"))
    }
    return found | groups | {"remote_agent.deploy"}


def test_pyproject_lists_every_package_and_deployment_group() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _packages_in_checkout()
    assert config["package-dir"] == {"remote_agent.deploy": "deploy"}
