"""
Hostile COBalD files and ``bus:`` sections: ``check-config`` and the ``bus:`` decoder answer
with bounded lines, whatever YAML aliases, tags and numbers build (no hang, no traceback)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.commands.config import format_report
from broker.tardis.check import check_file
from broker.tardis.config import decode_bus
from remote_agent.deploy_files import DEPLOY_DIR

pytestmark = pytest.mark.timeout(30)

DEPLOY = DEPLOY_DIR / "cobald"
HTCONDOR = (DEPLOY / "htcondor.yaml").read_text()
TARDIS_SECTION = HTCONDOR[HTCONDOR.index("tardis:\n") :]
#: nine lists of nine references to the one before: 9**9 leaves when walked as a tree
BOMB = ["  - &b0 [x, x, x, x, x, x, x, x, x]"] + [
    f"  - &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]" for i in range(1, 9)
]


def _check(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "cobald.yaml"
    path.write_text(text)
    report = check_file(path)
    assert len(format_report(report)) < 10_000
    assert all(len(line) < 1_000 for line in report.problems), report.problems
    return report.problems


@pytest.mark.parametrize(
    "pipeline",
    [
        ["  - &a [*a]"],  # a list that contains itself
        BOMB,
        ["  - &c0 [x]", *(f"  - &c{i} [*c{i - 1}]" for i in range(1, 3000))],  # 3000 deep
        ["  - {__type__: [a, b]}"],  # a type that cannot name a factory
    ],
    ids=["cyclic", "alias-bomb", "deep-aliases", "unhashable-type"],
)
def test_a_shared_or_cyclic_pipeline_is_walked_once(tmp_path: Path, pipeline: list[str]) -> None:
    problems = _check(tmp_path, "\n".join(["pipeline:", *pipeline, ""]))
    assert any("no cobald-remote pool factory" in line for line in problems)


def test_an_alias_bomb_in_bus_values_is_quoted_bounded(tmp_path: Path) -> None:
    factory = (
        "  - !RemoteTardisPoolFactory\n    interval: *b8\n    bus:\n"
        "      servers: [*b8]\n      lost_after_s: *b8\n"
    )
    problems = _check(tmp_path, "\n".join(["pipeline:", *BOMB, factory]) + TARDIS_SECTION)
    assert [line.split(":")[0] for line in problems if "bus." in line or "interval" in line] == [
        "pipeline[9].interval",
        "bus.servers",
        "bus.lost_after_s",
    ]


def test_sites_of_any_yaml_type_are_problems_not_tracebacks(tmp_path: Path) -> None:
    text = HTCONDOR.replace("quota: 400", "quota: {a: [1, 2, {b: c}]}")
    text = text.replace("      - wn8", "      - [1, 2]\n      - 3", 1)
    text = text.replace("  MySite:\n", "    - {name: [MySite, 2], adapter: {a: 1}}\n  MySite:\n")
    problems = _check(tmp_path, text)
    assert [line for line in problems if "site name" in line] == [
        "tardis.Sites: site name \"['MySite', 2]\" in lower case is not a subject token "
        "(1-128 of A-Z a-z 0-9 _ - (no dots, wildcards or whitespace)): drone uuids and "
        "subjects are made of it"
    ]
    out = format_report(check_file(tmp_path / "cobald.yaml"))
    assert "quota {'a': [1, 2, {...}]}, machine types [1, 2], 3;" in out


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ("!!python/object/apply:os.system ['true']", "could not determine a constructor"),
        ("1" * 5000, "Exceeds the limit"),  # beyond Python's digits for int()
    ],
    ids=["python-tag", "huge-int"],
)
def test_tags_and_huge_numbers_are_one_line(tmp_path: Path, value: str, found: str) -> None:
    text = HTCONDOR.replace("lost_after_s:", f"lost_after_s: {value}\n      x_:", 1)
    problems = _check(tmp_path, text)
    assert len(problems) == 1 and found in problems[0], problems


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -0.0, 1e309, 10**400, True, [[1]], {"a": 1}, "1" * 1_000_000],
    ids=["nan", "inf", "-0", "1e309", "10**400", "true", "nested", "mapping", "megabyte"],
)
def test_timing_keys_refuse_what_no_span_is(value: object) -> None:
    config, problems = decode_bus({"servers": "nats://127.0.0.1:4222", "lost_after_s": value})
    assert config is None
    assert len(problems) == 1 and problems[0].startswith("bus.lost_after_s: expected")
    assert len(problems[0]) < 300
