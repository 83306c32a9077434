"""
The deployment files: ``deploy/`` in the repository, ``remote_agent/deploy/`` in the wheel

The build maps the repository's top-level ``deploy/`` into the package
(``pyproject.toml``, ``[tool.setuptools.package-dir]``). One rule: code, tests
and ``cobald-remote deploy`` find the files through :data:`DEPLOY_DIR`, never
through either layout, so a wheel install has the same files as a clone. A
name given on the command line is looked up among the shipped files, never
joined onto a path.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import Final

from remote_agent.errors import DeployFileError

__all__ = ["DEPLOY_DIR", "DeployFileError", "copy", "select", "shipped"]


def _deploy_dir() -> Path:
    """
    Inside the installed package; in an editable install, the checkout's ``deploy/``

    An editable install imports ``remote_agent`` from the checkout, where the
    files sit beside the package instead of inside it.
    """
    package = Path(str(files("remote_agent")))
    installed = package / "deploy"
    return installed if installed.is_dir() else package.parent / "deploy"


#: the deployment files: one directory per group (``htcondor``, ``nats``, ...)
DEPLOY_DIR: Final = _deploy_dir()
#: mode of a copied file: executable when it starts with ``#!`` (hooks, drone job)
SCRIPT_MODE: Final = 0o755
DATA_MODE: Final = 0o644


def shipped() -> dict[str, Path]:
    """Every shipped file by its name ``group/file``, sorted"""
    found = {
        f"{group.name}/{item.name}": item
        for group in DEPLOY_DIR.iterdir()
        if group.is_dir() and not group.name.startswith((".", "_"))
        for item in group.iterdir()
        if item.is_file() and not item.name.startswith(".")
    }
    return dict(sorted(found.items()))


def select(name: str) -> dict[str, Path]:
    """The files of group ``name``, or the one file ``group/file``"""
    everything = shipped()
    chosen = {key: path for key, path in everything.items() if name in (key, key.split("/")[0])}
    if not chosen:
        groups = sorted({key.split("/")[0] for key in everything})
        raise DeployFileError(f"no deployment files named {name!r}; groups: {', '.join(groups)}")
    return chosen


def copy(name: str, target: Path, *, force: bool = False) -> list[Path]:
    """
    Copy the files of ``name`` (:func:`select`) into the directory ``target``

    Creates ``target``; refuses, before writing anything, to replace a file that
    differs unless ``force``. Returns the files written.
    """
    chosen = select(name)
    planned = [(source, target / source.name) for source in chosen.values()]
    clash = [str(dest) for source, dest in planned if dest.exists() and not _same(source, dest)]
    if clash and not force:
        raise DeployFileError(f"would replace {', '.join(clash)} (--force to replace)")
    try:
        target.mkdir(parents=True, exist_ok=True)
        for source, dest in planned:
            _write(source, dest)
    except OSError as err:
        raise DeployFileError(f"cannot copy {name!r} into {target}: {err}") from err
    return [dest for _, dest in planned]


def _same(source: Path, dest: Path) -> bool:
    try:
        return dest.is_file() and dest.read_bytes() == source.read_bytes()
    except OSError:
        return False


def _write(source: Path, dest: Path) -> None:
    data = source.read_bytes()
    mode = SCRIPT_MODE if data.startswith(b"#!") else DATA_MODE
    temp = dest.with_name(f".{dest.name}.tmp")
    with temp.open("wb") as stream:
        stream.write(data)
    os.chmod(temp, mode)
    os.replace(temp, dest)
