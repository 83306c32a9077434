"""
The architecture's rules, read from the code's imports

Five parts: the protocol both sides share (``remote_agent.protocol``), the drone
(the rest of ``remote_agent``), the manager side (``broker``), the TARDIS glue
(``broker.tardis``, ``broker.tardis_adapter``) and the commands
(``broker.commands``, ``broker.cli``). The emulators (``broker.emulation``)
stand in for sites and drones and may import anything.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("remote_agent", "broker")


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


MODULES = dict(_modules())

#: the repository's top level as the design names it: the two packages, the tests, the
#: deployment files (shipped inside the wheel, ``remote_agent.deploy_files``) and the project
LAYOUT_DIRECTORIES = ("remote_agent", "broker", "tests", "deploy")
LAYOUT_FILES = ("pyproject.toml",)


def test_the_repository_has_the_layout_the_design_names() -> None:
    assert [name for name in LAYOUT_DIRECTORIES if not (ROOT / name).is_dir()] == []
    assert [name for name in LAYOUT_FILES if not (ROOT / name).is_file()] == []
    # the deployment files are data, not code, and live at the top level only
    assert list((ROOT / "deploy").rglob("*.py")) == []
    assert not (ROOT / "remote_agent" / "deploy").exists()


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, lazily (inside functions) or not"""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _within(name: str, *packages: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _offences(allowed: object, *, where: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    found = []
    for module, path in MODULES.items():
        if not _within(module, *where) or (callable(allowed) and allowed(module)):
            continue
        found += [f"{module} imports {name}" for name in _imports(path) if _within(name, *banned)]
    return sorted(set(found))


def _emulator(module: str) -> bool:
    return _within(module, "broker.emulation")


def _tardis_glue(module: str) -> bool:
    return _within(module, "broker.tardis", "broker.tardis_adapter") or _emulator(module)


def test_the_drone_side_never_imports_the_manager_side() -> None:
    assert _offences(None, where=("remote_agent",), banned=("broker", "emulation")) == []


#: what the manager side may import of the drone side: the protocol, the agent's own
#: command, which the one console script wires in, and the shipped deployment files
_SHARED = (
    "remote_agent.protocol",
    "remote_agent.cli",
    "remote_agent.__version__",
    "remote_agent.deploy_files",
)


def test_the_manager_side_imports_the_drone_side_only_through_the_protocol() -> None:
    found = _offences(_emulator, where=("broker",), banned=("remote_agent",))
    imported = (offence.split(" imports ")[1] for offence in found)
    assert [
        offence
        for offence, name in zip(found, imported, strict=True)
        if name != "remote_agent" and not _within(name, *_SHARED)
    ] == []


def test_only_the_tardis_glue_imports_tardis_and_cobald() -> None:
    assert _offences(_tardis_glue, where=PACKAGES, banned=("tardis", "cobald")) == []


def test_the_protocol_imports_nothing_else_of_cobald_remote() -> None:
    found = [
        offence
        for offence in _offences(None, where=("remote_agent.protocol",), banned=PACKAGES)
        if not _within(offence.split(" imports ")[1], "remote_agent.protocol")
    ]
    assert found == []


#: what nats-py objects are called in this code base
_NATS_OBJECTS = frozenset({"nc", "client", "js", "sub", "subscription", "msg", "parser", "kv"})


def _touches_nats_internals(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in _NATS_OBJECTS
        ):
            return True
    return any(_within(name, "nats.protocol") for name in _imports(path))


def test_only_the_fast_path_touches_nats_py_internals() -> None:
    touching = sorted(module for module, path in MODULES.items() if _touches_nats_internals(path))
    assert touching == ["broker.jetstream.fastpath"]


@pytest.mark.parametrize("module", ["remote_agent.hooks", "remote_agent.protocol"])
def test_the_hook_path_imports_neither_asyncio_nor_nats(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(' '.join(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('asyncio', 'nats', 'broker', 'msgspec.json'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout.split()
    assert loaded == []


#: what a NATS name looks like inside a string: a subject's family token (``.evt.``,
#: ``.cmd``, ``.mgr.``), the KV and JetStream prefixes, inboxes, header names, the
#: bootstrap subject. ``remote_agent/protocol/names.py`` spells them; nothing else does.
_NATS_NAME = re.compile(
    r"\.(evt|cmd|mgr)(\.|\Z)|\A(evt|cmd|mgr)\.|\A(evt|mgr)\Z|\$KV\.|\$JS\.|\AKV_|_INBOX|\ANats-|\AKV-"
    r"|\.bootstrap(\.|\Z)|\A_BOOTSTRAP|\A_EVENTS\Z"
)


def _spelled_names(path: Path) -> Iterator[str]:
    """Strings (and pieces of f-strings) in ``path`` that spell a NATS name; docstrings aside"""
    tree = ast.parse(path.read_text(), str(path))
    docs = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and _NATS_NAME.search(node.value)
        ):
            yield f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"


def test_nats_names_are_built_only_in_names_py() -> None:
    names = ROOT / "remote_agent" / "protocol" / "names.py"
    assert [
        spelled for path in MODULES.values() if path != names for spelled in _spelled_names(path)
    ] == []
    # the rule reads what names.py spells
    assert len(list(_spelled_names(names))) >= 10
