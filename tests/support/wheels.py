"""
The project built as a release would be, and fresh venvs that install its wheel

A venv gets the wheel through pip (``--no-deps --no-index``: not editable, nothing
downloaded) and, for its dependencies, the distributions this test environment
already has: exactly those the wheel's metadata asks for (with the chosen extra)
and theirs in turn, linked into a directory on its ``sys.path``. What the wheel
does not ask for, such as ``tardis`` in the drone-side install, is not there.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Mapping
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
NAME = "cobald-remote"
_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*_cache", "results"
)


def build(out: Path) -> tuple[Path, Path]:
    """``python -m build`` of a copy of the checkout (it stays clean): ``(wheel, sdist)``"""
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=_SKIP)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        check=True,
        capture_output=True,
        text=True,
    )
    shutil.rmtree(source)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def _wanted(requirement: Requirement, extras: Iterable[str]) -> bool:
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": extra}) for extra in extras)


def closure(
    requires: Iterable[str], extras: Iterable[str] = ()
) -> dict[str, metadata.Distribution]:
    """The installed distributions that ``requires`` (with ``extras``) needs, transitively"""
    found: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(text), ("", *extras)) for text in requires]
    while todo:
        requirement, with_extras = todo.pop()
        name = canonicalize_name(requirement.name)
        if not _wanted(requirement, with_extras) or name == NAME or name in found:
            continue
        found[name] = dist = metadata.distribution(requirement.name)
        todo += [(Requirement(text), ("", *requirement.extras)) for text in dist.requires or ()]
    return found


def _link(dists: Mapping[str, metadata.Distribution], into: Path, scripts: Path) -> None:
    """Each distribution's top-level files into ``into``; its binaries into ``scripts``"""
    into.mkdir(parents=True)
    for dist in dists.values():
        for file in dist.files or ():
            source = Path(str(dist.locate_file(file))).resolve()
            if file.parts[0] == "..":  # a script or binary beside the interpreter
                target = scripts / source.name
                if source.is_file() and source.read_bytes()[:2] != b"#!" and not target.exists():
                    target.symlink_to(source)
                continue
            top = into / file.parts[0]
            if not top.exists():
                top.symlink_to(Path(str(dist.locate_file(file.parts[0]))).resolve())


def venv(where: Path, wheel: Path, extras: tuple[str, ...] = ()) -> Path:
    """A fresh venv with ``wheel`` and what it needs with ``extras``; returns its ``bin``"""
    env = clean_env()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, env=env)
    python = where / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "install", "--quiet", "--no-deps", "--no-index", "--no-compile", str(wheel)],
        check=True,
        env=env,
    )
    requires = metadata.Distribution.at(_dist_info(python)).requires or ()
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            env=env,
            text=True,
        ).stdout.strip()
    )
    _link(closure(requires, extras), where / "deps", where / "bin")
    (purelib / "deps.pth").write_text(f"{where / 'deps'}\n")
    subprocess.run([*pip, "check"], check=True, capture_output=True, env=env)
    return where / "bin"


def _dist_info(python: Path) -> Path:
    lib = python.parent.parent / "lib"
    (found,) = lib.glob(f"python3*/site-packages/{NAME.replace('-', '_')}-*.dist-info")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that points Python at the checkout or this venv"""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "VIRTUAL_ENV", "COBALD_REMOTE_", "NATS_", "Tardis"))
    }
    env["PATH"] = os.pathsep.join(
        part
        for part in env.get("PATH", "").split(os.pathsep)
        if part != sysconfig.get_path("scripts")
    )
    return {**env, **extra}


def repack(dist: metadata.Distribution, out: Path) -> Path:
    """
    A wheel of an installed distribution, from the files its ``RECORD`` lists

    For an install that must find its dependencies offline (``pip install --no-index
    --find-links``): the same versions this test environment runs, no download.
    """
    info = Path(str(dist.locate_file(next(f for f in dist.files or () if f.name == "WHEEL"))))
    lines = info.read_text().splitlines()
    tags = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Tag:")]
    parts = zip(*(tag.split("-") for tag in tags), strict=True)
    tag = "-".join(".".join(dict.fromkeys(part)) for part in parts)
    wheel = out / f"{info.parent.name.removesuffix('.dist-info')}-{tag}.whl"
    skipped = {"INSTALLER", "RECORD", "REQUESTED", "direct_url.json"}
    record: list[str] = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in dist.files or ():
            metadata_file = file.parts[0] == info.parent.name and file.name in skipped
            if ".." in file.parts or "__pycache__" in file.parts or metadata_file:
                continue
            data = Path(str(dist.locate_file(file))).read_bytes()
            archive.writestr(file.as_posix(), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{file.as_posix()},sha256={digest.decode()},{len(data)}")
        record.append(f"{info.parent.name}/RECORD,,")
        archive.writestr(f"{info.parent.name}/RECORD", "\n".join(record) + "\n")
    return wheel


def dependency_wheels(wheel: Path, out: Path) -> list[Path]:
    """Wheels of what ``wheel`` needs (no extras), repacked from this environment, in ``out``"""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(archive.read(name).decode()).get_all("Requires-Dist") or []
    out.mkdir(parents=True, exist_ok=True)
    return [repack(dist, out) for dist in closure(requires).values()]
