"""Every command's ``--help`` text and usage exit code, against a stored snapshot

The commands, options, help texts and exit codes are a contract with operators
and their scripts. Regenerate the snapshot on purpose only:
``COBALD_REMOTE_SNAPSHOT=write pytest tests/unit/test_help_snapshot.py``.

Every supported Python checks the same snapshot: the texts are compared with
their whitespace collapsed, because argparse's layout differs between versions
where the words do not (3.13 sets the help column by its own rule and wraps
usage lines elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from broker.cli import build_parser
from broker.cli import main as cli_main
from broker.commands.options import CREDS_ENV, SERVER_ENV
from remote_agent.hooks import build_parser as hooks_parser
from remote_agent.hooks import main as hooks_main

SNAPSHOT = Path(__file__).parent / "snapshots" / "help.json"


def _paths(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _paths(sub, (*prefix, name))


def _run(main: Callable[[Sequence[str]], int], argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, out.getvalue()


def _observe() -> dict[str, dict[str, object]]:
    seen: dict[str, dict[str, object]] = {}
    for name, main, parser in (
        ("cobald-remote", cli_main, build_parser()),
        ("python -m remote_agent.hooks", hooks_main, hooks_parser()),
    ):
        for path in _paths(parser):
            code, text = _run(main, [*path, "--help"])
            wrong, _ = _run(main, [*path, "--no-such-option"])
            facts: dict[str, object] = {"help_exit": code, "help": text, "usage_exit": wrong}
            if _is_group(parser, path):  # a group without its command: usage, no action
                facts["bare_exit"], facts["bare"] = _run(main, list(path))
            seen[" ".join((name, *path))] = facts
    return seen


def _is_group(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> bool:
    for name in path:
        parser = next(
            a.choices[name] for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        )
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


@pytest.fixture(autouse=True)
def _fixed_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    for name in (*SERVER_ENV, *CREDS_ENV):  # they make --server optional
        monkeypatch.delenv(name, raising=False)


def _words(facts: dict[str, object]) -> dict[str, object]:
    """``facts`` with every text's whitespace collapsed: argparse's layout left out"""
    return {key: " ".join(value.split()) if isinstance(value, str) else value
            for key, value in facts.items()}  # fmt: skip


def test_every_help_text_and_exit_code_is_as_recorded() -> None:
    seen = _observe()
    if os.environ.get("COBALD_REMOTE_SNAPSHOT") == "write":
        SNAPSHOT.write_text(json.dumps({"commands": seen}, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(SNAPSHOT.read_text())["commands"]
    assert sorted(seen) == sorted(recorded), "commands were added or removed"
    for command, facts in recorded.items():
        assert _words(seen[command]) == _words(facts), command


def test_only_whitespace_is_left_out() -> None:
    texts = {"help": "usage: x [-h]\n\noptions:\n  -h, --help  show this", "help_exit": 0}
    assert _words(texts) == {"help": "usage: x [-h] options: -h, --help show this", "help_exit": 0}
    assert _words({"help": "a  b"}) != _words({"help": "a-b"})
