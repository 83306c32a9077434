"""
The manager's Prometheus collector, read from the live counters of its parts

Its rule: it keeps no counts of its own; every scrape reads the registry, the
consumer, the TARDIS integration and the bootstrap issuer anew, so nothing is counted twice.
"""

from __future__ import annotations

import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from broker.jetstream.messages import ConsumerStats
from broker.manager.blackholes import BlackHoles, Verdict
from broker.manager.issuer import QUEUE_FULL
from broker.manager.registry import Registry
from broker.manager.retire import Retired
from remote_agent import __version__
from remote_agent.protocol.bootstrap import Refusal
from remote_agent.protocol.events import DroneState, RecordPhase

PREFIX: Final = "cobald_remote_"
#: a part of the TARDIS integration named ``site:<name>`` counts for TARDIS's site ``<name>``
SITE_PART: Final = "site:"
#: a TARDIS count named ``<call>_failed`` counts the failures of ``<call>``
FAILED: Final = "_failed"

_STATES: Final = (*(str(state) for state in DroneState), "unknown")
_PHASES: Final = (*(str(phase) for phase in RecordPhase), "tampered", "none")


@dataclass(frozen=True, slots=True)
class Sources:
    """
    Where the numbers come from (each part but the registry is optional)

    Every callable may be called from the metrics server's thread: it must only
    read (the registry's views are immutable and replaced whole).

    :param registry: the drone registry
    :param consumer: counters of the event stream's consumer (kept across reconnects)
    :param connected: whether the manager is connected and consuming
    :param failures: manager sessions that failed (connection, consumer) so far
    :param rebuild_seconds: how long the last rebuild took
    :param tardis_calls: what the TARDIS integration did: by part (``bus``,
        ``site:<name>``, ``batch_system``), counts by name (``<call>_failed``: failures)
    :param notes_buffered: TARDIS state notes waiting for the bus
    :param issuer_counts: what the bootstrap issuer did (``issued_enroll``,
        ``issued_renew``, ``refused_<reason>``, ``dropped_reply_subject``, ``alarms``,
        ``clock_skewed``, ``minted``, ``queue_full:<site>``; kept across reconnects)
    :param retired: the drones retired since the manager started, and their records
    :param state_runs_delayed: TARDIS state runs that waited for their drone's budget so far
    :param noisy_state_runs: drones whose TARDIS state runs waited for their budget within
        the last minute (:data:`~broker.manager.budget.NOISY_FOR_S`)
    :param black_holes: the black-hole detector and the probes of flagged sites
    """

    registry: Registry
    consumer: ConsumerStats | None = None
    connected: Callable[[], bool] | None = None
    failures: Callable[[], int] | None = None
    rebuild_seconds: Callable[[], float | None] | None = None
    tardis_calls: Callable[[], Mapping[str, Mapping[str, int]]] | None = None
    notes_buffered: Callable[[], int] | None = None
    issuer_counts: Callable[[], Mapping[str, int]] | None = None
    retired: Callable[[], Retired] | None = None
    state_runs_delayed: Callable[[], int] | None = None
    noisy_state_runs: Callable[[], int] | None = None
    black_holes: BlackHoles | None = None


def tardis_labels(part: str, name: str) -> tuple[str, str, str, str]:
    """
    The labels ``part``, ``site``, ``call``, ``outcome`` of one TARDIS count

    ``("site:Site1", "deploy_resource_failed")`` is ``("site", "Site1",
    "deploy_resource", "failed")``; a count without ``_failed`` is ``ok``.
    """
    site = ""
    if part.startswith(SITE_PART):
        part, site = "site", part.removeprefix(SITE_PART)
    if name.endswith(FAILED) and len(name) > len(FAILED):
        return part, site, name.removesuffix(FAILED), "failed"
    return part, site, name, "ok"


def _counter(
    name: str, help_text: str, label: str, samples: Iterable[tuple[str, int]]
) -> CounterMetricFamily:
    """A counter family with one label, a sample per ``(label value, count)``"""
    family = CounterMetricFamily(PREFIX + name, help_text, labels=(label,))
    for value, count in samples:
        family.add_metric([value], count)
    return family


def _by_site(
    name: str, help_text: str, label: str, counts: Mapping[str, Mapping[str, int]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, help_text, labels=("site", label))
    for site, by_key in sorted(counts.items()):
        for key, count in by_key.items():
            family.add_metric([site, key], count)
    return family


class ManagerCollector(Collector):
    """
    Every ``cobald_remote_*`` family, from :class:`Sources`

    Drone counts by state and by handshake phase list every state and phase,
    zeros included, for every site with a drone.

    :param clock: the time to judge lost drones by, epoch seconds
    """

    def __init__(self, sources: Sources, clock: Callable[[], float] = time.time) -> None:
        self.sources = sources
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield from self._registry()
        yield from self._drones()
        if self.sources.consumer is not None:
            yield from self._consumer(self.sources.consumer)
        yield from self._manager()
        yield from self._tardis()
        if self.sources.black_holes is not None:
            yield from self._black_holes(self.sources.black_holes)
        yield from self._issuer()
        build = InfoMetricFamily(
            PREFIX + "build", "The version of cobald-remote and of Python the manager runs"
        )
        build.add_metric([], {"version": __version__, "python": platform.python_version()})
        yield build

    def _registry(self) -> Iterator[Metric]:
        metrics = self.sources.registry.metrics()
        yield _counter(
            "registry_events",
            "Events the registry handled, by outcome (rejected: see registry_rejected; "
            "coalesced: beyond its drone's budget, superseded by a newer one before it applied)",
            "outcome",
            [
                ("applied", metrics.applied),
                ("duplicate", metrics.duplicate),
                ("stale", metrics.stale),
                ("coalesced", metrics.coalesced),
            ],
        )
        yield _counter(
            "registry_rejected",
            "Events and records rejected as invalid, by reason; they changed nothing",
            "reason",
            sorted(metrics.rejected.items()),
        )
        yield _counter(
            "registry_records",
            "Handshake-bucket values merged into the registry, by outcome",
            "outcome",
            [("applied", metrics.records_applied), ("ignored", metrics.records_ignored)],
        )
        yield GaugeMetricFamily(
            PREFIX + "drones_ended",
            "Drones whose life ended (drained, released, removed), kept until their retention ends",
            value=metrics.ended,
        )
        yield GaugeMetricFamily(
            PREFIX + "drones_clock_skewed",
            "Drones whose newest heartbeat shows a clock off the server's by more than "
            "clock_skew_warn_s (nothing the manager decides reads a drone's clock)",
            value=metrics.clock_skewed,
        )

    def _drones(self) -> Iterator[Metric]:
        registry = self.sources.registry
        now = self.clock()
        by_state: defaultdict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(_STATES, 0))
        by_phase: defaultdict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(_PHASES, 0))
        lost = 0
        for view in registry.views().values():
            by_phase[view.site][view.record.label if view.record is not None else "none"] += 1
            if view.ended:
                continue
            by_state[view.site][str(view.state) if view.state is not None else "unknown"] += 1
            lost += view.counts_lost(now, registry.lost_after_s)
        yield _by_site(
            "drones",
            "Drones whose life has not ended, by site and the state of their newest event "
            "(unknown: only a handshake record)",
            "state",
            by_state,
        )
        yield _by_site(
            "drone_records",
            "Drones known to the registry (ended ones too), by site and the phase of their "
            "handshake record (none: no record)",
            "phase",
            by_phase,
        )
        yield GaugeMetricFamily(
            PREFIX + "drones_lost",
            "Drones whose life has not ended and whose agent was silent for longer than "
            "lost_after_s",
            value=lost,
        )
        noisy = GaugeMetricFamily(
            PREFIX + "drones_noisy",
            "Drones over their budget within the last minute, by budget: events (applied "
            "events a second), state_runs (TARDIS state runs a second)",
            labels=("budget",),
        )
        noisy.add_metric(["events"], len(registry.noisy(now)))
        if self.sources.noisy_state_runs is not None:
            noisy.add_metric(["state_runs"], self.sources.noisy_state_runs())
        yield noisy

    def _consumer(self, stats: ConsumerStats) -> Iterator[Metric]:
        yield _counter(
            "consumer_messages",
            "Event-stream messages the manager's consumer handled, by what it answered "
            "(termed: rejected, or the handler raised)",
            "outcome",
            [("acked", stats.acked), ("termed", stats.termed), ("nacked", stats.nacked)],
        )
        yield _counter(
            "consumer_handler_errors",
            "Event-stream messages whose handler raised, by exception type; each was "
            "terminated and changed nothing",
            "exception",
            sorted(dict(stats.handler_error_types).items()),
        )
        yield CounterMetricFamily(
            PREFIX + "consumer_max_deliveries",
            "Messages the server stopped delivering after max_deliver deliveries without an answer",
            value=stats.max_deliveries,
        )
        yield CounterMetricFamily(
            PREFIX + "consumer_pull_requests",
            "Pull requests the manager's consumer sent",
            value=stats.requests,
        )
        yield CounterMetricFamily(
            PREFIX + "consumer_watchdog",
            "Pull requests re-issued because neither messages nor heartbeats came",
            value=stats.watchdog,
        )
        yield CounterMetricFamily(
            PREFIX + "consumer_direct_fallbacks",
            "Consumer starts that took nats-py's slower Msg path because its internals "
            "are not what direct dispatch expects (see the WARNING line)",
            value=stats.direct_fallbacks,
        )

    def _manager(self) -> Iterator[Metric]:
        sources = self.sources
        if sources.connected is not None:
            yield GaugeMetricFamily(
                PREFIX + "connected",
                "1 while the manager is connected, rebuilt and consuming",
                value=int(sources.connected()),
            )
        if sources.failures is not None:
            yield CounterMetricFamily(
                PREFIX + "manager_session_failures",
                "Manager sessions that failed (connection, consumer) and were started again",
                value=sources.failures(),
            )
        seconds = sources.rebuild_seconds() if sources.rebuild_seconds is not None else None
        if seconds is not None:
            yield GaugeMetricFamily(
                PREFIX + "rebuild_seconds",
                "How long the last rebuild of the registry took",
                value=float(seconds),
            )
        if sources.notes_buffered is not None:
            yield GaugeMetricFamily(
                PREFIX + "tardis_notes_buffered",
                "TARDIS state notes waiting to be published",
                value=sources.notes_buffered(),
            )
        if sources.state_runs_delayed is not None:
            yield CounterMetricFamily(
                PREFIX + "tardis_state_runs_delayed",
                "TARDIS state runs that waited for their drone's budget (each saw every fact "
                "that came meanwhile)",
                value=sources.state_runs_delayed(),
            )
        if sources.retired is not None:
            retired = sources.retired()
            yield _counter(
                "drones_retired",
                "Drones dropped from the registry after their retention: ended ones after "
                "retain_ended_s, lost ones never ended after retain_lost_s",
                "why",
                [("ended", retired.retired - retired.lost), ("lost", retired.lost)],
            )
            yield _counter(
                "records_retired",
                "Handshake records of retired drones: purged, kept (the bucket denies "
                "purges), or retried later (the purge failed for now)",
                "outcome",
                [("purged", retired.purged), ("kept", retired.kept), ("retried", retired.retried)],
            )

    def _tardis(self) -> Iterator[Metric]:
        if self.sources.tardis_calls is None:
            return
        calls = CounterMetricFamily(
            PREFIX + "tardis_calls",
            "What the TARDIS integration did, by part (bus, site, batch_system), TARDIS's "
            'site name, call and outcome (docs: operations, "Metrics (Prometheus)")',
            labels=("part", "site", "call", "outcome"),
        )
        # copies first: the TARDIS side adds counts on the event loop meanwhile
        parts = dict(self.sources.tardis_calls())
        for part, counts in sorted(parts.items()):
            for name, count in sorted(dict(counts).items()):
                calls.add_metric(list(tardis_labels(part, name)), count)
        yield calls

    def _black_holes(self, detector: BlackHoles) -> Iterator[Metric]:
        counts = detector.counts()
        flags = detector.flags
        drones = CounterMetricFamily(
            PREFIX + "black_hole_drones",
            "Drones found to be black holes, by site and verdict (died: ended unasked without "
            "a payload soon after their start; failing: their payloads failed at once in a row)",
            labels=("site", "verdict"),
        )
        flagged = GaugeMetricFamily(
            PREFIX + "black_hole_site",
            "1 while the site is flagged as a black hole (its pools ask for probe drones only), "
            "else 0; every site with a black-hole drone",
            labels=("site",),
        )
        for site, by_verdict in sorted(counts.items()):
            for verdict in Verdict:
                drones.add_metric([site, str(verdict)], by_verdict.get(verdict, 0))
            flagged.add_metric([site], int(site in flags))
        yield drones
        yield flagged
        yield _counter(
            "black_hole_probes",
            "Probe drones the pools asked for at sites flagged as black holes, by site",
            "site",
            sorted(dict(detector.probes).items()),
        )
        yield _counter(
            "black_hole_withheld",
            "Pool adjustments that wanted more drones of a site flagged as a black hole and "
            "asked for none (waiting for the next probe), by site",
            "site",
            sorted(dict(detector.withheld).items()),
        )

    def _issuer(self) -> Iterator[Metric]:
        if self.sources.issuer_counts is None:
            return
        counts = dict(self.sources.issuer_counts())  # a copy: the issuer counts meanwhile
        yield _counter(
            "bootstrap_issued",
            "Drone identities (user JWTs) the issuer signed, by kind of request",
            "kind",
            [(kind, counts.get(f"issued_{kind}", 0)) for kind in ("enroll", "renew")],
        )
        yield _counter(
            "bootstrap_refused",
            "Bootstrap requests the issuer refused, by reason; they changed nothing "
            "(the manager log names the drone and the site)",
            "reason",
            [(str(reason), counts.get(f"refused_{reason}", 0)) for reason in Refusal],
        )
        yield CounterMetricFamily(
            PREFIX + "bootstrap_dropped",
            "Bootstrap requests answered nowhere: their reply subject was not their site's "
            "bootstrap inbox",
            value=counts.get("dropped_reply_subject", 0),
        )
        yield _counter(
            "bootstrap_queue_full",
            "Bootstrap requests dropped unread because their site's queue was full (a flood "
            "from the site's bootstrap identity, or more of its drones asking at once than "
            "the issuer answers), by site",
            "site",
            sorted(
                (name.removeprefix(QUEUE_FULL), count)
                for name, count in counts.items()
                if name.startswith(QUEUE_FULL)
            ),
        )
        yield CounterMetricFamily(
            PREFIX + "bootstrap_alarms",
            "Bootstrap tokens used again by another key: stolen, or a second job with the "
            "drone's uuid",
            value=counts.get("alarms", 0),
        )
        yield CounterMetricFamily(
            PREFIX + "bootstrap_clock_skewed",
            "Bootstrap requests signed by a clock off the issuer's by more than "
            "clock_skew_warn_s; answered all the same",
            value=counts.get("clock_skewed", 0),
        )
        yield CounterMetricFamily(
            PREFIX + "bootstrap_tokens_minted",
            "One-time bootstrap tokens minted for deployed drones",
            value=counts.get("minted", 0),
        )


def collector_registry(
    sources: Sources, clock: Callable[[], float] = time.time
) -> CollectorRegistry:
    """
    A registry of its own (not prometheus_client's global one) with the manager's
    families and the process's (memory, CPU, open files) and Python's
    """
    registry = CollectorRegistry()
    registry.register(ManagerCollector(sources, clock))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
