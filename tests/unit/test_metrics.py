"""Prometheus metrics: the text, read back by prometheus_client's parser"""

from __future__ import annotations

import collections
import shutil
import subprocess
import time
from collections.abc import Mapping
from platform import python_version as platform
from types import MappingProxyType

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.drones import FakeDrone
from support.metrics import NS, SITE, fleet, parsed
from support.registry import jobs_gone

from broker.jetstream.messages import ConsumerStats
from broker.manager.blackholes import BlackHoles, Rules
from broker.manager.budget import NOISY_FOR_S, Budget
from broker.manager.collector import tardis_labels
from broker.manager.issuer import QUEUE_FULL
from broker.manager.metrics import Sources, render
from broker.manager.registry import Registry
from broker.manager.retire import Retired
from broker.manager.views import DroneView
from broker.tardis_adapter import BusConfig, RemoteBus
from remote_agent import __version__
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import Refusal


def test_render_is_valid_exposition_with_the_registry_counts() -> None:
    now = time.time()
    registry = Registry(NS)
    fleet(registry, now)
    stats = ConsumerStats(
        acked=6,
        termed=3,
        handler_errors=2,
        handler_error_types={"RecursionError": 1, "ValueError": 1},
        max_deliveries=4,
        requests=2,
        watchdog=1,
    )
    counts = {
        "bus": collections.Counter(notes_published=4),
        "site:Site1": {"drain_accepted": 2, "deploy_resource_failed": 3},
    }
    text = render(
        Sources(
            registry=registry,
            consumer=stats,
            connected=lambda: True,
            failures=lambda: 3,
            rebuild_seconds=lambda: 0.25,
            tardis_calls=lambda: counts,
            notes_buffered=lambda: 5,
        ),
        now=now,
    )
    samples = parsed(text)
    metrics = registry.metrics()

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("cobald_remote_registry_events_total", outcome="applied") == metrics.applied == 7
    assert value("cobald_remote_registry_events_total", outcome="duplicate") == 1
    assert value("cobald_remote_registry_events_total", outcome="stale") == 1
    assert value("cobald_remote_registry_rejected_total", reason="malformed") == 1
    assert value("cobald_remote_registry_rejected_total", reason="sender") == 0
    assert value("cobald_remote_registry_records_total", outcome="applied") == 1
    assert value("cobald_remote_drones", site=SITE, state="idle") == 1
    assert value("cobald_remote_drones", site=SITE, state="busy") == 1
    assert value("cobald_remote_drones", site=SITE, state="starting") == 1
    assert value("cobald_remote_drones", site=SITE, state="unknown") == 1  # only a record
    assert value("cobald_remote_drones", site=SITE, state="draining") == 0  # every state
    assert value("cobald_remote_drone_records", site=SITE, phase="released") == 1
    assert value("cobald_remote_drone_records", site=SITE, phase="none") == 3
    assert value("cobald_remote_drones_ended") == metrics.ended
    assert value("cobald_remote_drones_lost") == 1
    assert value("cobald_remote_consumer_messages_total", outcome="acked") == 6
    assert value("cobald_remote_consumer_messages_total", outcome="termed") == 3
    assert ("cobald_remote_consumer_messages_total", (("outcome", "failed"),)) not in samples
    errors = "cobald_remote_consumer_handler_errors_total"
    assert value(errors, exception="RecursionError") == value(errors, exception="ValueError") == 1
    assert value("cobald_remote_consumer_max_deliveries_total") == 4
    assert value("cobald_remote_consumer_pull_requests_total") == 2
    assert value("cobald_remote_consumer_watchdog_total") == 1
    assert value("cobald_remote_connected") == 1
    assert value("cobald_remote_manager_session_failures_total") == 3
    assert value("cobald_remote_rebuild_seconds") == 0.25
    calls = "cobald_remote_tardis_calls_total"
    assert value(calls, part="bus", site="", call="notes_published", outcome="ok") == 4
    assert value(calls, part="site", site="Site1", call="drain_accepted", outcome="ok") == 2
    assert value(calls, part="site", site="Site1", call="deploy_resource", outcome="failed") == 3
    assert value("cobald_remote_build_info", version=__version__, python=platform()) == 1
    assert value("cobald_remote_tardis_notes_buffered") == 5
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families["cobald_remote_registry_events"] == "counter"
    assert families["cobald_remote_drones"] == "gauge"


def test_render_with_only_a_registry_names_no_other_family() -> None:
    text = render(Sources(registry=Registry(NS)))
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {name for name in names if name.startswith("cobald_remote_")} == {
        "cobald_remote_registry_events",
        "cobald_remote_registry_rejected",
        "cobald_remote_registry_records",
        "cobald_remote_drones",
        "cobald_remote_drone_records",
        "cobald_remote_drones_lost",
        "cobald_remote_drones_noisy",
        "cobald_remote_drones_ended",
        "cobald_remote_drones_clock_skewed",
        "cobald_remote_build_info",
    }
    assert "process_resident_memory_bytes" in names
    assert "process_cpu_seconds" in names


def test_label_values_are_escaped() -> None:
    counts = {"bus": {'odd "name"\\with\nnewline': 1}}
    text = render(Sources(registry=Registry(NS), tardis_calls=lambda: counts))
    assert (
        parsed(text)[
            (
                "cobald_remote_tardis_calls_total",
                (
                    ("call", 'odd "name"\\with\nnewline'),
                    ("outcome", "ok"),
                    ("part", "bus"),
                    ("site", ""),
                ),
            )
        ]
        == 1
    )


def _full_sources(registry: Registry) -> Sources:
    stats = ConsumerStats(acked=1, handler_error_types={"KeyError": 1})
    counts = {
        "bus": collections.Counter(notes_published=1, notes_dropped=2),
        "site:Site1": {"deploy_resource_failed": 1, "stop_resource_deferred": 2},
        "site:Site2": {"status_from_agent": 3},
        "batch_system": {"drain_failed": 1, "drain_accepted": 1},
    }
    return Sources(
        registry=registry,
        consumer=stats,
        connected=lambda: False,
        failures=lambda: 0,
        rebuild_seconds=lambda: 1.5,
        tardis_calls=lambda: counts,
        notes_buffered=lambda: 0,
        issuer_counts=lambda: collections.Counter(
            issued_enroll=2, refused_reused=1, alarms=1, minted=3
        ),
        retired=lambda: Retired(retired=5, purged=4, kept=1, lost=2),
        black_holes=_black_holes(registry),
    )


def _black_holes(registry: Registry) -> BlackHoles:
    """A detector watching ``registry`` that flagged ``site9`` and gave its pool one probe"""
    detector = BlackHoles(Rules(backoff_s=1.0))
    registry.watchers.append(detector.seen)
    jobs_gone(registry, "site9")
    assert detector.allowance("site9", 0.0) == 0
    assert detector.allowance("site9", 1.0) == 1
    return detector


def test_black_hole_sites_their_drones_probes_and_withheld_growth() -> None:
    registry = Registry(NS)
    detector = _black_holes(registry)
    jobs_gone(registry, "site8", drones=1, at=2000.0)  # one black hole: not flagged
    samples = parsed(render(Sources(registry=registry, black_holes=detector)))
    drones = "cobald_remote_black_hole_drones_total"
    assert samples[(drones, (("site", "site9"), ("verdict", "died")))] == 3
    assert samples[(drones, (("site", "site9"), ("verdict", "failing")))] == 0
    assert samples[(drones, (("site", "site8"), ("verdict", "died")))] == 1
    assert samples[("cobald_remote_black_hole_site", (("site", "site9"),))] == 1
    assert samples[("cobald_remote_black_hole_site", (("site", "site8"),))] == 0
    assert samples[("cobald_remote_black_hole_probes_total", (("site", "site9"),))] == 1
    assert samples[("cobald_remote_black_hole_withheld_total", (("site", "site9"),))] == 1
    # without a detector (no TARDIS): no such family
    assert "black_hole" not in render(Sources(registry=Registry(NS)))


def test_exposition_names_every_family_once_with_help_and_type() -> None:
    registry = Registry(NS)
    fleet(registry, time.time())
    text = render(_full_sources(registry))
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names))
    assert all(family.documentation for family in families)
    series = [
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in families
        for sample in family.samples
    ]
    assert len(series) == len(set(series))
    lines = text.splitlines()
    for kind in ("HELP", "TYPE"):
        declared = [line.split()[2] for line in lines if line.startswith(f"# {kind} ")]
        assert len(declared) == len(set(declared)) == len(families)
    sampled = {line.split("{")[0].split()[0] for line in lines if not line.startswith("#")}
    typed = {line.split()[2] for line in lines if line.startswith("# TYPE ")}
    assert sampled <= typed


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_finds_nothing_to_complain_about() -> None:
    registry = Registry(NS)
    fleet(registry, time.time())
    promtool = shutil.which("promtool")
    assert promtool is not None
    done = subprocess.run(
        [promtool, "check", "metrics"],
        input=render(_full_sources(registry)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_issuer_families_list_every_refusal_zeros_included() -> None:
    counts = collections.Counter(
        issued_enroll=5,
        issued_renew=7,
        refused_forged=2,
        refused_throttled=3,
        dropped_reply_subject=4,
        alarms=1,
        minted=9,
    )
    counts[f"{QUEUE_FULL}site1"] = 1000
    counts[f"{QUEUE_FULL}site2"] = 6
    samples = parsed(render(Sources(registry=Registry(NS), issuer_counts=lambda: counts)))
    issued = "cobald_remote_bootstrap_issued_total"
    assert samples[(issued, (("kind", "enroll"),))] == 5
    assert samples[(issued, (("kind", "renew"),))] == 7
    refused = {
        labels[0][1]: value
        for (name, labels), value in samples.items()
        if name == "cobald_remote_bootstrap_refused_total"
    }
    assert refused == {str(reason): 0 for reason in Refusal} | {"forged": 2, "throttled": 3}
    assert samples[("cobald_remote_bootstrap_dropped_total", ())] == 4
    assert samples[("cobald_remote_bootstrap_alarms_total", ())] == 1
    assert samples[("cobald_remote_bootstrap_tokens_minted_total", ())] == 9
    full = "cobald_remote_bootstrap_queue_full_total"
    assert samples[(full, (("site", "site1"),))] == 1000
    assert samples[(full, (("site", "site2"),))] == 6


def test_an_issuer_that_did_nothing_yet_shows_zeros() -> None:
    samples = parsed(render(Sources(registry=Registry(NS), issuer_counts=collections.Counter)))
    assert samples[("cobald_remote_bootstrap_issued_total", (("kind", "renew"),))] == 0
    assert samples[("cobald_remote_bootstrap_refused_total", (("reason", "reused"),))] == 0
    assert samples[("cobald_remote_bootstrap_dropped_total", ())] == 0
    assert samples[("cobald_remote_bootstrap_alarms_total", ())] == 0
    assert samples[("cobald_remote_bootstrap_tokens_minted_total", ())] == 0


@pytest.mark.parametrize("issuing", [True, False])
def test_the_bus_exports_the_issuer_counts_when_it_issues(issuing: bool) -> None:
    settings = {"servers": "nats://127.0.0.1:4222", "metrics": "127.0.0.1:0"}
    if issuing:
        settings["bootstrap_key"] = "issuer.key"  # read when the issuer starts
    bus = RemoteBus(BusConfig.from_mapping(settings), register=False)
    assert bus.metrics is not None
    bus.manager.issuer_counts["issued_enroll"] += 2
    samples = parsed(generate_latest(bus.metrics.registry).decode())
    enrolled = samples.get(("cobald_remote_bootstrap_issued_total", (("kind", "enroll"),)))
    assert enrolled == (2 if issuing else None)


def test_the_bus_exports_the_retirements_by_why_and_their_records_by_outcome() -> None:
    bus = RemoteBus(
        BusConfig.from_mapping({"servers": "nats://127.0.0.1:4222", "metrics": "127.0.0.1:0"}),
        register=False,
    )
    assert bus.metrics is not None
    bus.manager.retired = Retired(retired=7, purged=6, kept=0, retried=1, lost=3)
    samples = parsed(generate_latest(bus.metrics.registry).decode())
    retired = "cobald_remote_drones_retired_total"
    assert samples[(retired, (("why", "ended"),))] == 4
    assert samples[(retired, (("why", "lost"),))] == 3
    records = "cobald_remote_records_retired_total"
    assert samples[(records, (("outcome", "purged"),))] == 6
    assert samples[(records, (("outcome", "kept"),))] == 0
    assert samples[(records, (("outcome", "retried"),))] == 1


class _EndingRegistry(Registry):
    """A registry whose views of ``ending`` drones say their life ended"""

    ending: frozenset[str] = frozenset()

    def views(self) -> Mapping[tuple[str, str], DroneView]:
        return MappingProxyType(
            {
                key: msgspec.structs.replace(view, ended="drained", ended_time=0.0)
                if view.drone in self.ending
                else view
                for key, view in super().views().items()
            }
        )


def test_an_ended_drone_is_neither_a_live_drone_nor_lost() -> None:
    now = time.time()
    registry = _EndingRegistry(NS)
    fleet(registry, now)
    before = parsed(render(Sources(registry=registry), now=now))
    registry.ending = frozenset({"site1-0000000003"})  # the silent one
    after = parsed(render(Sources(registry=registry), now=now))
    starting = ("cobald_remote_drones", (("site", SITE), ("state", "starting")))
    assert (before[starting], after[starting]) == (1, 0)
    assert (
        before[("cobald_remote_drones_lost", ())],
        after[("cobald_remote_drones_lost", ())],
    ) == (
        1,
        0,
    )
    none = ("cobald_remote_drone_records", (("phase", "none"), ("site", SITE)))
    assert before[none] == after[none] == 3  # its record is still known


@pytest.mark.parametrize(
    ("part", "name", "labels"),
    [
        ("bus", "notes_published", ("bus", "", "notes_published", "ok")),
        ("site:Site1", "deploy_resource_failed", ("site", "Site1", "deploy_resource", "failed")),
        ("site:Site1", "stop_resource_deferred", ("site", "Site1", "stop_resource_deferred", "ok")),
        ("batch_system", "drain_failed", ("batch_system", "", "drain", "failed")),
        ("bus", "_failed", ("bus", "", "_failed", "ok")),
    ],
)
def test_tardis_labels_split_part_site_call_and_outcome(
    part: str, name: str, labels: tuple[str, str, str, str]
) -> None:
    assert tardis_labels(part, name) == labels


def test_noisy_drones_and_what_their_budgets_put_off() -> None:
    """A drone over its budget: counted noisy for a minute, its superseded events coalesced"""
    now = time.time()
    registry = Registry(NS, budget=Budget(per_s=10.0, burst=2))
    drone = FakeDrone(SITE, "site1-00000000aa")
    for seq in range(1, 6):
        event = drone.heartbeat()
        registry.apply_message(ev.encode(event), drone.subject(event, NS), now - 1, seq, now=0.0)
    registry.release_held(1.0)
    sources = Sources(registry=registry, state_runs_delayed=lambda: 7, noisy_state_runs=lambda: 3)
    samples = parsed(render(sources, now=now))
    assert samples[("cobald_remote_registry_events_total", (("outcome", "coalesced"),))] == 2
    assert samples[("cobald_remote_registry_events_total", (("outcome", "applied"),))] == 3
    assert samples[("cobald_remote_drones_noisy", (("budget", "events"),))] == 1
    assert samples[("cobald_remote_drones_noisy", (("budget", "state_runs"),))] == 3
    assert samples[("cobald_remote_tardis_state_runs_delayed_total", ())] == 7
    later = parsed(render(sources, now=now + NOISY_FOR_S))
    assert later[("cobald_remote_drones_noisy", (("budget", "events"),))] == 0
