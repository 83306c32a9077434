"""
deploy/grafana/cobald-remote.json: valid, every query names what the manager exports

The names and labels a query uses are read with a small PromQL scan and checked
against a scrape of the collector with every source present; where promtool
exists, each query is also parsed by Prometheus itself (as a recording rule).
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.registry import jobs_gone

from broker.jetstream.messages import ConsumerStats
from broker.manager.blackholes import BlackHoles
from broker.manager.issuer import QUEUE_FULL
from broker.manager.metrics import Sources, render
from broker.manager.registry import Registry
from broker.manager.retire import Retired
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace

DASHBOARD = DEPLOY_DIR / "grafana" / "cobald-remote.json"
#: labels Prometheus adds to every series it scrapes
TARGET_LABELS = {"job", "instance"}
#: what Grafana puts in for its variables, so that a query can be parsed
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "6h", "$__interval": "1m"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_WORD = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}
_LABEL_VALUES = re.compile(r"^label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*(\w+)\s*\)$")


def promql_names(expr: str) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """
    The metric names, ``(name, label)`` matchers and grouping labels of ``expr``

    Enough PromQL for dashboard queries: strings, ranges and matchers are cut out
    before the remaining words are read; a word followed by ``(`` is a function.
    """
    text = _RANGE.sub("", _STRING.sub('""', expr))
    grouping = {
        label.strip() for _, labels in _GROUPING.findall(text) for label in labels.split(",")
    } - {""}
    text = _GROUPING.sub(" ", text)
    matched = {
        (name, label)
        for name, matchers in _SELECTOR.findall(text)
        for label in _MATCHER.findall(matchers)
    }
    text = re.sub(r"\{[^}]*\}", " ", text)
    names = {
        found.group()
        for found in _WORD.finditer(text)
        if found.group() not in _KEYWORDS and not text[found.end() :].lstrip().startswith("(")
    }
    return names, matched, grouping


def test_promql_names_reads_selectors_functions_and_grouping() -> None:
    names, matched, grouping = promql_names(
        'sum by (site, call) (rate(a_total{job=~"$job", call=~".+_(x|y)"}[$__rate_interval]))'
        " / on (site) group_left b offset 5m > bool 1e3"
    )
    assert names == {"a_total", "b"}
    assert matched == {("a_total", "job"), ("a_total", "call")}
    assert grouping == {"site", "call"}


def _exported() -> dict[str, set[str]]:
    """Every sample name a scrape has, with its labels, every source present"""
    registry = Registry(Namespace())
    record = ev.DroneRecord(
        site="site1",
        drone="site1-0000000001",
        phase=ev.RecordPhase.UP,
        writer="agent",
        at=ev.utcnow(),
    )
    registry.apply_record(record, 1, time.time())
    detector = BlackHoles()
    registry.watchers.append(detector.seen)
    jobs_gone(registry, "site2")
    detector.allowance("site2", 0.0)  # withheld: the first probe waits
    detector.allowance("site2", 1e9)  # a probe
    text = render(
        Sources(
            registry=registry,
            consumer=ConsumerStats(handler_error_types={"KeyError": 1}),
            connected=lambda: True,
            failures=lambda: 0,
            rebuild_seconds=lambda: 1.0,
            tardis_calls=lambda: {"bus": collections.Counter(notes_published=1)},
            notes_buffered=lambda: 0,
            issuer_counts=lambda: collections.Counter({f"{QUEUE_FULL}site1": 1}),
            retired=Retired,
            state_runs_delayed=lambda: 0,
            noisy_state_runs=lambda: 0,
            black_holes=detector,
        )
    )
    labels: dict[str, set[str]] = collections.defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels[sample.name] |= set(sample.labels)
    return dict(labels)


def _dashboard() -> dict[str, Any]:
    value = json.loads(DASHBOARD.read_text())
    assert isinstance(value, dict)
    return value


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target"""
    return [
        (panel["title"], target["expr"])
        for panel in _panels(_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_every_query_names_only_exported_metrics_and_their_labels() -> None:
    exported = _exported()
    assert len(_queries()) >= 15
    for title, expr in _queries():
        names, matched, grouping = promql_names(expr)
        assert names, (title, expr)
        unknown = names - set(exported)
        assert not unknown, f"{title}: {expr} names {unknown}, not exported"
        known = set().union(*(exported[name] for name in names)) | TARGET_LABELS
        for name, label in matched:
            assert label in exported[name] | TARGET_LABELS, f"{title}: {name} has no {label}"
        assert grouping <= known, f"{title}: grouping by {grouping - known}"


def test_every_variable_query_names_an_exported_label() -> None:
    exported = _exported()
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = _LABEL_VALUES.match(variable["query"]["query"])
        assert found, variable["name"]
        name, label = found.groups()
        assert label in exported[name] | TARGET_LABELS, variable["name"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_prometheus_parses_every_query(tmp_path: Path) -> None:
    rules = []
    for number, (_, expr) in enumerate(_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query{number}", "expr": expr})
    path = tmp_path / "rules.json"  # JSON is YAML, which promtool reads
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool = shutil.which("promtool")
    assert promtool is not None
    done = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
