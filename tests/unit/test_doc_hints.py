"""What the product prints names documentation sections, not files: the wheel has no docs/"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: a path into docs/, as a printed hint would cite it
_FILE = re.compile(r"docs/\w+\.md")
#: the form a hint takes instead: the guide and its section, which DOCS has
_SECTION = re.compile(r'docs: (\w+), "([^"]+)"')


def _strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of ``path`` but its docstrings, implicit concatenations joined"""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def _sources() -> list[Path]:
    # the demonstration's options are left to its own change (broker/commands/demo.py)
    skipped = {ROOT / "broker" / "commands" / "demo.py"}
    found = [*(ROOT / "broker").rglob("*.py"), *(ROOT / "remote_agent").rglob("*.py")]
    return [path for path in found if path not in skipped]


def test_no_printed_text_cites_a_docs_file() -> None:
    cited = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in _sources()
        for line, text in _strings(path)
        if _FILE.search(text)
    ]
    assert cited == []


def test_every_cited_section_exists() -> None:
    headings = {
        path.stem: {
            line.lstrip("#").strip() for line in path.read_text().splitlines() if line[:1] == "#"
        }
        for path in (ROOT / "docs").glob("*.md")
    }
    cited = {
        (guide, section)
        for path in _sources()
        for _, text in _strings(path)
        for guide, section in _SECTION.findall(text)
    }
    assert len(cited) >= 8
    assert {(g, s) for g, s in cited if s not in headings.get(g, set())} == set()


def test_building_the_wheel_installs_the_build_frontend_first() -> None:
    """Where a guide first says ``python -m build``, it said ``pip install build`` before"""
    for path in (ROOT / "docs").glob("*.md"):
        text = path.read_text()
        first = text.find("python -m build")
        if first >= 0:
            assert 0 <= text.find("pip install build") < first, path.name
