"""The drone registry (pure state), without a server"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.drones import FakeDrone
from support.registry import NS, PROOF_KEY, SITE, apply_event, event_subject, make_record

from broker.manager.registry import Applied, Registry
from broker.manager.validity import Rejection
from broker.manager.verdict import Removal, removal_verdict
from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import check_sender
from remote_agent.protocol.proof import record_proof


def test_newest_event_wins_and_older_ones_are_counted() -> None:
    registry = Registry(NS)
    drone = FakeDrone(SITE, "site1-0000000001")
    first, second = drone.started(), drone.ready()
    assert apply_event(registry, second, 2.0, stream_seq=2) is Applied.APPLIED
    assert apply_event(registry, first, 1.0, stream_seq=1) is Applied.STALE
    assert apply_event(registry, second, 2.0, stream_seq=2) is Applied.DUPLICATE
    view = registry.view(SITE, drone.drone)
    assert view is not None
    assert (view.seq, view.kind, view.state, view.received_time) == (
        second.seq,
        "startd_ready",
        ev.DroneState.IDLE,
        2.0,
    )
    assert view.event_time == second.at.timestamp()
    metrics = registry.metrics()
    assert (metrics.applied, metrics.stale, metrics.duplicate, metrics.drones) == (1, 1, 1, 1)


def test_the_event_stored_last_wins_whatever_its_seq() -> None:
    """A forged future seq hides nothing stored after it; a restarted agent supersedes"""
    registry = Registry(NS)
    drone = FakeDrone(SITE, "site1-0000000001")
    forged = msgspec.structs.replace(drone.heartbeat(), seq=2**64 - 1)
    assert apply_event(registry, forged, 1.0, stream_seq=10) is Applied.APPLIED
    restarted = msgspec.structs.replace(drone.started(), incarnation="inc2", seq=5)
    assert apply_event(registry, restarted, 2.0, stream_seq=11) is Applied.APPLIED
    view = registry.view(SITE, drone.drone)
    assert view is not None
    assert (view.seq, view.stream_seq, view.incarnation) == (5, 11, "inc2")


def test_heartbeat_facts_and_payload_start_times() -> None:
    registry = Registry(NS)
    drone = FakeDrone(SITE, "site1-0000000001")
    beat = drone.heartbeat(interval_s=20)
    started = drone.payload_started("7.0")
    apply_event(registry, started, 5.0, stream_seq=2)
    # the heartbeat was delivered after the newer event: still the newest heartbeat
    assert apply_event(registry, beat, 6.0, stream_seq=1) is Applied.STALE
    view = registry.view(SITE, drone.drone)
    assert view is not None
    assert (view.heartbeat_seq, view.heartbeat_time, view.heartbeat_interval_s) == (
        beat.seq,
        6.0,
        20,
    )
    assert view.kind == "payload_started"
    assert [p.job_id for p in view.payloads] == ["7.0"]
    assert view.payloads[0].started_at == drone.payloads[0].started_at
    assert view.last_seen == 6.0


# --------------------------------------------------------------------------- reordering

_ACTIONS = st.sampled_from(["heartbeat", "start", "finish", "drained", "exiting"])


def _story(drone: FakeDrone, actions: list[str]) -> list[ev.Event]:
    out: list[ev.Event] = [drone.started(), drone.ready()]
    jobs = itertools.count()
    for action in actions:
        if action == "heartbeat":
            out.append(drone.heartbeat())
        elif action == "start":
            out.append(drone.payload_started(f"{next(jobs)}.0"))
        elif action == "finish" and drone.payloads:
            out.append(drone.payload_finished(drone.payloads[0].job_id))
        elif action == "drained":
            out.append(drone.drained())
        elif action == "exiting":
            out.append(drone.exiting())
    return out


@settings(max_examples=150, deadline=None)
@given(
    stories=st.lists(st.lists(_ACTIONS, max_size=12), min_size=1, max_size=4),
    data=st.data(),
)
def test_reordered_and_duplicated_deliveries_converge(
    stories: list[list[str]], data: st.DataObject
) -> None:
    deliveries: list[tuple[bytes, str, float, int]] = []
    for number, actions in enumerate(stories):
        drone = FakeDrone(SITE, f"site1-{number:010x}")
        for event in _story(drone, actions):
            # the stream's time of storing grows with the stream order
            stream_seq = len(deliveries) + 1
            deliveries.append(
                (ev.encode(event), event_subject(event), float(stream_seq), stream_seq)
            )
    in_order = Registry(NS)
    for delivery in deliveries:
        in_order.apply_message(*delivery)

    shuffled = data.draw(st.permutations(deliveries), label="order")
    repeats = data.draw(
        st.lists(st.sampled_from(deliveries), max_size=len(deliveries)), label="repeats"
    )
    mixed = list(shuffled)
    for repeat in repeats:
        mixed.insert(data.draw(st.integers(0, len(mixed)), label="position"), repeat)
    other = Registry(NS)
    for delivery in mixed:
        assert other.apply_message(*delivery) is not Applied.REJECTED
    assert dict(other.views()) == dict(in_order.views())
    metrics = other.metrics()
    assert metrics.applied + metrics.stale + metrics.duplicate == len(mixed)


@settings(max_examples=100, deadline=None)
@given(order=st.permutations(range(6)))
def test_records_converge_by_revision(order: list[int]) -> None:
    phases = [ev.RecordPhase.UP, ev.RecordPhase.DRAINING, ev.RecordPhase.DRAINED]
    writes = [(make_record(phases[i % 3]), i + 1, float(i)) for i in range(6)]
    registry = Registry(NS)
    for i in order:
        registry.apply_record(*writes[i])
    view = registry.view(SITE, "site1-0000000001")
    assert view is not None and view.record is not None
    assert (view.record.revision, view.record.phase, view.record.stored) == (
        6,
        phases[5 % 3],
        5.0,
    )


def test_own_record_is_confirmed_by_the_watch() -> None:
    registry = Registry(NS)
    record = make_record(ev.RecordPhase.RELEASED, "manager")
    registry.apply_record(record, 7, None)
    view = registry.view(SITE, record.drone)
    assert view is not None and view.record is not None and view.record.stored is None
    assert registry.apply_record(record, 7, 123.0) is Applied.DUPLICATE
    view = registry.view(SITE, record.drone)
    assert view is not None and view.record is not None and view.record.stored == 123.0


# --------------------------------------------------------------------------- bad input


def _bad_deliveries() -> list[tuple[bytes, str, Rejection]]:
    drone = FakeDrone(SITE, "site1-0000000001")
    event = drone.heartbeat()
    data = ev.encode(event)
    other = FakeDrone(SITE, "site1-0000000002").heartbeat()
    versioned = msgspec.msgpack.encode(msgspec.to_builtins(event) | {"v": 2})
    return [
        (b"\xc1garbage", event_subject(event), Rejection.MALFORMED),
        (b"", event_subject(event), Rejection.MALFORMED),
        (versioned, event_subject(event), Rejection.MALFORMED),
        (ev.encode(make_record(ev.RecordPhase.UP)), event_subject(event), Rejection.MALFORMED),
        (b"\x00" * 70_000, event_subject(event), Rejection.OVERSIZED),
        # a drone speaking for another, or for another kind
        (ev.encode(other), event_subject(event), Rejection.SENDER),
        (data, NS.event(SITE, drone.drone, "drained"), Rejection.SENDER),
        (data, NS.event("site2", drone.drone, "heartbeat"), Rejection.SENDER),
        (data, f"other.{SITE}.{drone.drone}.evt.heartbeat", Rejection.SUBJECT),
        (data, NS.manager_note(SITE, drone.drone, "heartbeat"), Rejection.SUBJECT),
    ]


@pytest.mark.parametrize(("data", "subject", "reason"), _bad_deliveries())
def test_bad_events_are_rejected_counted_and_change_nothing(
    data: bytes, subject: str, reason: Rejection
) -> None:
    registry = Registry(NS)
    drone = FakeDrone(SITE, "site1-0000000001")
    apply_event(registry, drone.started(), 1.0)
    before = dict(registry.views())
    assert registry.apply_message(data, subject, 2.0) is Applied.REJECTED
    assert dict(registry.views()) == before
    metrics = registry.metrics()
    assert metrics.rejected[reason] == 1
    assert metrics.rejected_total == 1
    assert metrics.applied == 1


def test_sender_check_agrees_with_events_check_sender() -> None:
    """The registry and events.check_sender apply the one sender rule alike"""
    drone = FakeDrone(SITE, "site1-0000000001")
    event = drone.heartbeat()
    subjects = [
        event_subject(event),
        *(subject for _, subject, _ in _bad_deliveries()),
        NS.event(SITE, "site1-0000000002", "heartbeat"),
    ]
    for subject in subjects:
        registry = Registry(NS)
        try:
            check_sender(event, subject, NS)
            expected = True
        except SchemaError:
            expected = False
        assert (registry.apply(event, subject, 1.0) is not Applied.REJECTED) is expected


def test_bad_records_are_rejected() -> None:
    registry = Registry(NS)
    record = make_record(ev.RecordPhase.UP)
    good = ev.encode(record)
    assert registry.apply_record_message("site1.site1-0000000001", good, 1, 1.0) is Applied.APPLIED
    before = dict(registry.views())
    # a key that names no drone changes nothing
    assert registry.apply_record_message("nodot", good, 4, 1.0) is Applied.REJECTED
    assert registry.apply_record_message("a.b.c", good, 5, 1.0) is Applied.REJECTED
    assert dict(registry.views()) == before
    # a value that is no valid record of its key's drone leaves that drone's record tampered
    assert registry.apply_record_message("site1.site1-0000000009", good, 2, 1.0) is Applied.REJECTED
    assert registry.apply_record_message("site1.x", b"junk", 3, 1.0) is Applied.REJECTED
    assert registry.view(SITE, "site1-0000000001") == before[(SITE, "site1-0000000001")]
    for drone in ("site1-0000000009", "x"):
        view = registry.view(SITE, drone)
        assert view is not None and view.record is not None
        assert (view.record.phase, view.record.tampered) == (None, "invalid value")
    assert registry.metrics().rejected[Rejection.RECORD] == 4


def test_a_removed_record_is_tampered_not_forgotten() -> None:
    registry = Registry(NS)
    registry.apply_record(make_record(ev.RecordPhase.UP), 3, 1.0)
    registry.record_removed("site1.site1-0000000001", 2, 1.0, "DEL")  # older: ignored
    view = registry.view(SITE, "site1-0000000001")
    assert view is not None and view.record is not None and view.phase is ev.RecordPhase.UP
    registry.record_removed("site1.site1-0000000001", 4, 2.0, "PURGE")
    view = registry.view(SITE, "site1-0000000001")
    assert view is not None and view.record is not None
    assert (view.record.phase, view.record.tampered, view.record.revision) == (
        None,
        "removed (PURGE)",
        4,
    )
    verdict = removal_verdict(view, True, 2.0, 90.0)
    assert (verdict.allowed, verdict.reason) == (False, Removal.RECORD_TAMPERED)


def test_only_the_managers_proof_makes_a_release() -> None:
    registry = Registry(NS)
    registry.proof_key = PROOF_KEY
    forged = make_record(ev.RecordPhase.RELEASED, "manager")
    registry.apply_record(forged, 1, 1.0)
    view = registry.view(SITE, forged.drone)
    verdict = removal_verdict(view, True, 1.0, 90.0)
    assert (verdict.allowed, verdict.reason) == (False, Removal.UNPROVEN_RELEASE)
    wrong = msgspec.structs.replace(forged, proof=record_proof(b"x" * 32, forged))
    registry.apply_record(wrong, 2, 1.0)
    assert not removal_verdict(registry.view(SITE, forged.drone), True, 1.0, 90.0).allowed
    proven = msgspec.structs.replace(forged, proof=record_proof(PROOF_KEY, forged))
    registry.apply_record(proven, 3, 1.0)
    verdict = removal_verdict(registry.view(SITE, forged.drone), True, 1.0, 90.0)
    assert (verdict.allowed, verdict.reason) == (True, Removal.RELEASED_BY_MANAGER)
    # the proof covers every field: changing one breaks it
    moved = msgspec.structs.replace(proven, drone="site1-0000000002")
    registry.apply_record(moved, 4, 1.0)
    assert not removal_verdict(registry.view(SITE, moved.drone), True, 1.0, 90.0).allowed


def test_drained_record_while_the_newest_event_lists_payloads() -> None:
    registry = Registry(NS)
    drone = FakeDrone(SITE, "site1-0000000001")
    apply_event(registry, drone.payload_started("1.0"), 1.0)
    registry.apply_record(make_record(ev.RecordPhase.DRAINED), 1, 1.0)
    verdict = removal_verdict(registry.view(SITE, drone.drone), True, 1.0, 90.0)
    assert (verdict.allowed, verdict.reason) == (False, Removal.DRAINED_BUT_BUSY)


# --------------------------------------------------------------------------- lost


def test_lost_marking() -> None:
    registry = Registry(NS, lost_after_s=90)
    drone = FakeDrone(SITE, "site1-0000000001")
    apply_event(registry, drone.heartbeat(), 1000.0)
    registry.apply_record(
        make_record(ev.RecordPhase.RELEASED, "manager", "site1-0000000002"), 1, 0.0
    )
    assert registry.mark_lost(1089.0) == []
    newly = registry.mark_lost(1090.0)
    assert [v.drone for v in newly] == [drone.drone]
    assert registry.mark_lost(1100.0) == []  # reported once
    view = registry.view(SITE, drone.drone)
    assert view is not None and view.lost
    assert registry.metrics().lost == 1
    # a drone known only from the manager's record is unknown, not lost
    released = registry.view(SITE, "site1-0000000002")
    assert released is not None and not released.lost
    # the next event clears it
    apply_event(registry, drone.heartbeat(), 1101.0)
    view = registry.view(SITE, drone.drone)
    assert view is not None and not view.lost
    assert registry.mark_lost(1102.0) == []


def test_agent_record_is_a_sign_of_life() -> None:
    registry = Registry(NS, lost_after_s=90)
    registry.apply_record(make_record(ev.RecordPhase.UP), 1, 500.0)
    view = registry.view(SITE, "site1-0000000001")
    assert view is not None and view.last_seen == 500.0
    assert [v.drone for v in registry.mark_lost(600.0)] == ["site1-0000000001"]


def test_lost_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lost_after_s"):
        Registry(NS, lost_after_s=0)
