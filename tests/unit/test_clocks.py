"""
A drone's clock in the manager's decisions: read only as a span, never compared with the
manager's; a clock far off is flagged and counted, and changes nothing else
"""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest
from support.drones import FakeDrone
from support.registry import NS, PROOF_KEY, SITE, apply_event, make_record

from broker.manager.lifecycle import forgotten_at
from broker.manager.registry import Registry, drain_due
from broker.manager.verdict import Removal, removal_verdict
from broker.manager.views import DroneView, RecordView, elapsed_since
from broker.tardis.release import Durations, release_choice
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import dedupe_id
from remote_agent.protocol.proof import record_proof

NOW = 1_800_000_000.0
DAY = 86400.0
DRONE = "site1-0000000001"
#: clocks as wrong as worker nodes' get: a day ahead, ten days behind, ten years ahead
OFFSETS = [0.0, 25 * 3600.0, -10 * DAY, 10 * 365 * DAY]


def _utc(epoch: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, dt.UTC)


def _intent(requested: float, duration_s: float, request_id: str = "r1") -> ev.DrainIntent:
    return ev.DrainIntent(
        deadline=_utc(requested + duration_s), requested_at=_utc(requested), request_id=request_id
    )


def _record(
    phase: ev.RecordPhase, writer: str, intent: ev.DrainIntent | None, proven: bool = False
) -> ev.DroneRecord:
    record = msgspec.structs.replace(make_record(phase, writer, DRONE), drain=intent)
    if proven:
        record = msgspec.structs.replace(record, proof=record_proof(PROOF_KEY, record))
    return record


def _drone(offset: float) -> FakeDrone:
    """A drone whose clock is ``offset`` ahead of the server's (its next event is stored
    at the second it was made)"""
    return FakeDrone(SITE, DRONE, clock=_utc(NOW + offset - 1))


def _registry() -> Registry:
    registry = Registry(NS, lost_after_s=90.0)
    registry.proof_key = PROOF_KEY
    return registry


def _record_view(registry: Registry) -> RecordView:
    view = registry.view(SITE, DRONE)
    assert view is not None and view.record is not None
    return view.record


# --------------------------------------------------------------------------- drain deadlines


def test_the_managers_own_drain_is_due_at_its_deadline() -> None:
    intent = _intent(NOW, DAY)
    record = _record(ev.RecordPhase.DRAINING, "manager", intent, proven=True)
    assert drain_due(record, True, NOW + 3, None) == NOW + DAY


@pytest.mark.parametrize("offset", OFFSETS)
def test_an_agents_drain_is_due_its_span_after_the_manager_learned_of_it(offset: float) -> None:
    """The agent's self-drain, written by its clock: only the span counts"""
    intent = _intent(NOW + offset, 3600.0)
    record = _record(ev.RecordPhase.DRAINING, "agent", intent)
    assert drain_due(record, False, NOW, None) == NOW + 3600.0


@pytest.mark.parametrize("offset", OFFSETS)
def test_an_agent_cannot_bring_a_known_drain_forward(offset: float) -> None:
    """The manager's drain of a day, rewritten by the agent: the same intent keeps its due
    time; another intent (a forged one of a second) is due no sooner than the first"""
    registry = _registry()
    intent = _intent(NOW, DAY)
    registry.apply_record(_record(ev.RecordPhase.DRAINING, "manager", intent, True), 1, NOW)
    assert _record_view(registry).drain_due == NOW + DAY
    expired = _record(ev.RecordPhase.DEADLINE_EXPIRED, "agent", intent)
    registry.apply_record(expired, 2, NOW + 5)
    assert _record_view(registry).drain_due == NOW + DAY
    forged = _record(ev.RecordPhase.DEADLINE_EXPIRED, "agent", _intent(NOW + offset, 1.0, "x"))
    registry.apply_record(forged, 3, NOW + 6)
    assert _record_view(registry).drain_due == NOW + DAY


def test_after_a_rebuild_a_rewritten_drain_is_due_later_never_sooner() -> None:
    """Only the newest revision is in the bucket: its own time is where the span starts"""
    record = _record(ev.RecordPhase.DEADLINE_EXPIRED, "agent", _intent(NOW, DAY))
    assert drain_due(record, False, NOW + 60, None) == NOW + 60 + DAY


@pytest.mark.parametrize("offset", OFFSETS)
def test_deadline_expired_is_a_removal_only_once_the_manager_says_it_is_due(
    offset: float,
) -> None:
    """The agent's ``deadline_expired`` on a drain of a day, written at once by a clock
    a day ahead (or an agent that judged by its wall clock): not before the day is over"""
    registry = _registry()
    drone = _drone(offset)
    apply_event(registry, drone.heartbeat(), NOW)
    intent = _intent(NOW, DAY)
    registry.apply_record(_record(ev.RecordPhase.DRAINING, "manager", intent, True), 1, NOW)
    registry.apply_record(_record(ev.RecordPhase.DEADLINE_EXPIRED, "agent", intent), 2, NOW + 1)
    view = registry.view(SITE, DRONE)
    early = removal_verdict(view, True, NOW + 2, 90.0)
    assert (early.allowed, early.reason) == (False, Removal.DEADLINE_NOT_DUE)
    assert "due in" in early.detail
    apply_event(registry, drone.heartbeat(), NOW + DAY)
    late = removal_verdict(registry.view(SITE, DRONE), True, NOW + DAY, 90.0)
    assert (late.allowed, late.reason) == (True, Removal.DEADLINE_EXPIRED)


def test_deadline_expired_without_a_drain_is_no_removal_while_the_agent_speaks() -> None:
    registry = _registry()
    apply_event(registry, FakeDrone(SITE, DRONE).heartbeat(), NOW)
    registry.apply_record(_record(ev.RecordPhase.DEADLINE_EXPIRED, "agent", None), 1, NOW)
    verdict = removal_verdict(registry.view(SITE, DRONE), True, NOW + DAY * 365, 1e9)
    assert (verdict.allowed, verdict.reason) == (False, Removal.DEADLINE_NOT_DUE)


@pytest.mark.parametrize("offset", OFFSETS)
def test_a_drain_written_by_a_wrong_clock_neither_delays_nor_hastens_retirement(
    offset: float,
) -> None:
    """A lost drone is retired ``retain_lost_s`` after its newest fact, or at its drain's due
    time by the manager's reckoning if later: a deadline ten years ahead delays nothing"""
    registry = _registry()
    apply_event(registry, FakeDrone(SITE, DRONE).heartbeat(), NOW)
    record = _record(ev.RecordPhase.DRAINING, "agent", _intent(NOW + offset, 3600.0))
    registry.apply_record(record, 1, NOW)
    view = registry.view(SITE, DRONE)
    assert view is not None
    assert forgotten_at(view, 7 * DAY) == NOW + 7 * DAY
    assert forgotten_at(view, 60.0) == NOW + 3600.0


# --------------------------------------------------------------------------- runtimes


def _busy(registry: Registry, drone: str, offset: float, age_s: float) -> DroneView:
    """``drone``'s clock is ``offset`` off; its payload started ``age_s`` before ``NOW``"""
    at = _utc(NOW + offset)
    snapshot = ev.Snapshot(
        state=ev.DroneState.BUSY,
        since=at,
        gate_open=True,
        slots=2,
        payloads=[ev.Payload(job_id="1.0", started_at=_utc(NOW + offset - age_s))],
        started_at=at,
    )
    event = ev.Heartbeat(
        site=SITE,
        drone=drone,
        incarnation="inc1",
        seq=1,
        at=at,
        id=dedupe_id(drone, "inc1", 1),
        snapshot=snapshot,
        interval_s=30.0,
    )
    registry.apply(event, NS.event(SITE, drone, "heartbeat"), NOW)
    view = registry.view(SITE, drone)
    assert view is not None
    return view


@pytest.mark.parametrize("offset", OFFSETS)
def test_a_payloads_runtime_is_the_same_whatever_its_drones_clock(offset: float) -> None:
    registry = Registry(NS)
    view = _busy(registry, f"site1-00000000{len(str(offset)):02d}", offset, 600.0)
    event = view.event
    assert event is not None and view.received_time is not None
    started = view.payloads[0].started_at
    assert elapsed_since(started, event, view.received_time, NOW + 100) == pytest.approx(700.0)


def test_the_release_order_does_not_read_a_drones_clock() -> None:
    """Two drones, one payload each, as old as each other: the same place in the order,
    though one clock is a day ahead (by it, its payload would look a day old)"""
    registry = Registry(NS)
    durations = Durations()
    for _ in range(10):
        durations.add(1000.0)
    right = release_choice(_busy(registry, "site1-00000000aa", 0.0, 600.0), 2, 0, durations, NOW)
    ahead = _busy(registry, "site1-00000000bb", 25 * 3600.0, 600.0)
    assert release_choice(ahead, 2, 0, durations, NOW) == right
    assert right.left_s == pytest.approx(400.0)


# --------------------------------------------------------------------------- the flag


@pytest.mark.parametrize(
    ("offset", "skewed"),
    [(0.0, False), (59.0, False), (61.0, True), (-80.0, False), (-100.0, True), (-10 * DAY, True)],
)
def test_a_clock_off_by_more_than_the_threshold_is_flagged(offset: float, skewed: bool) -> None:
    """Ahead by more than the threshold, or behind by more than it and a heartbeat
    interval (a heartbeat spooled through an outage reaches the bus that late)"""
    registry = Registry(NS, clock_skew_warn_s=60.0)
    drone = _drone(offset)
    apply_event(registry, drone.heartbeat(interval_s=30.0), NOW)
    view = registry.view(SITE, DRONE)
    assert view is not None and view.clock_offset_s == pytest.approx(offset)
    assert view.clock_skewed(60.0) is skewed
    assert registry.metrics().clock_skewed == int(skewed)


def test_the_flag_follows_the_newest_heartbeat_and_leaves_with_the_drone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = Registry(NS)
    drone = _drone(DAY)
    apply_event(registry, drone.heartbeat(), NOW, stream_seq=1)
    assert registry.metrics().clock_skewed == 1
    assert "is 86400s (24.0 h) ahead of the server's" in caplog.text
    drone.clock = _utc(NOW + 29)  # its time service caught up
    apply_event(registry, drone.heartbeat(), NOW + 30, stream_seq=2)
    assert registry.metrics().clock_skewed == 0
    drone.clock = _utc(NOW + 59 + DAY)
    apply_event(registry, drone.heartbeat(), NOW + 60, stream_seq=3)
    view = registry.view(SITE, DRONE)
    assert view is not None and registry.metrics().clock_skewed == 1
    registry.apply_record(make_record(ev.RecordPhase.DRAINED, "agent", DRONE), 1, NOW + 61)
    apply_event(registry, drone.exiting(), NOW + 62, stream_seq=4)
    registry.mark_ended(NOW + 62)
    (done,) = registry.due_retirements(NOW + 62 + 2 * DAY)
    assert registry.retire(done)
    assert registry.metrics().clock_skewed == 0
