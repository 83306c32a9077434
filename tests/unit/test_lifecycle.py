"""The end of a drone's life in the registry: each ending, clearing, never lost, retirement"""

from __future__ import annotations

import datetime as dt
import logging

import pytest
from support.drones import FakeDrone

from broker.manager import lifecycle
from broker.manager.lifecycle import TARDIS_DOWN, Ending
from broker.manager.registry import Applied, Registry
from broker.manager.validity import Rejection
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import MSG_ID, Namespace
from remote_agent.protocol.proof import record_proof
from remote_agent.protocol.ratelog import RateLimitedLog

REGISTRY_LOG = "cobald.runtime.cobald_remote.registry"

NS = Namespace()
SITE = "site1"
DRONE = "site1-0000000001"
KEY = b"k" * 32
LOST = 90.0


@pytest.fixture(autouse=True)
def _every_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No line held back by another test's"""
    monkeypatch.setattr(lifecycle, "lines", RateLimitedLog(lifecycle.log, interval_s=0.0))


def _registry() -> Registry:
    registry = Registry(NS, lost_after_s=LOST, retain_ended_s=1000.0)
    registry.proof_key = KEY
    return registry


def _event(registry: Registry, event: ev.Event, at: float, seq: int) -> Applied:
    subject = NS.event(event.site, event.drone, ev.kind_of(type(event)))
    return registry.apply_message(ev.encode(event), subject, at, seq, {MSG_ID: event.id})


def _record(
    registry: Registry, phase: ev.RecordPhase, revision: int, at: float, writer: str = "agent"
) -> None:
    record = ev.DroneRecord(
        site=SITE,
        drone=DRONE,
        phase=phase,
        writer=writer,  # type: ignore[arg-type]
        at=dt.datetime.fromtimestamp(at, dt.UTC),
    )
    if writer == "manager":
        record = ev.DroneRecord(
            **{f: getattr(record, f) for f in record.__struct_fields__ if f != "proof"},
            proof=record_proof(KEY, record),
        )
    assert registry.apply_record(record, revision, at) is Applied.APPLIED


def _note(
    registry: Registry, state: str, at: float, seq: int, drone: str = DRONE, **headers: str
) -> Applied:
    note = ev.TardisState(
        site=SITE, drone=drone, state=state, at=dt.datetime.fromtimestamp(at, dt.UTC), id="n1"
    )
    subject = NS.manager_note(SITE, drone, "tardis_state")
    return registry.apply_note_message(
        ev.encode(note), subject, at, seq, {MSG_ID: note.id, **headers}
    )


def _view(registry: Registry) -> tuple[str, float | None, bool]:
    view = registry.view(SITE, DRONE)
    assert view is not None
    return view.ended, view.ended_time, view.lost


def _drained_and_exited(registry: Registry) -> FakeDrone:
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.started(), 1.0, 1)
    _record(registry, ev.RecordPhase.UP, 1, 1.0)
    _event(registry, drone.drained(), 10.0, 2)
    _record(registry, ev.RecordPhase.DRAINED, 2, 10.0)
    _event(registry, drone.exiting(), 11.0, 3)
    return drone


def test_drained_and_exiting_ends_and_is_never_lost() -> None:
    registry = _registry()
    _drained_and_exited(registry)
    assert [v.drone for v in registry.mark_ended(12.0)] == [DRONE]
    assert _view(registry) == (Ending.DRAINED, 11.0, False)
    assert registry.mark_lost(11.0 + 10 * LOST) == []
    metrics = registry.metrics()
    assert (metrics.ended, metrics.lost) == (1, 0)
    assert registry.mark_ended(13.0) == []  # nothing changed: nothing looked at again


def test_drained_and_silent_ends_when_it_would_be_lost() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.started(), 1.0, 1)
    _record(registry, ev.RecordPhase.DRAINED, 1, 5.0)
    assert registry.mark_ended(6.0) == []
    assert registry.mark_ended(5.0 + LOST - 1) == []
    assert len(registry.mark_ended(5.0 + LOST)) == 1
    assert _view(registry) == (Ending.DRAINED, 5.0 + LOST, False)
    assert registry.mark_lost(5.0 + LOST) == []


def test_released_drone_ends_only_when_its_agent_says_it_exits() -> None:
    registry = _registry()
    _record(registry, ev.RecordPhase.RELEASED, 1, 1.0, writer="manager")
    registry.mark_ended(1e9)
    assert _view(registry)[0] == ""  # silence never ends it: its job may still be queued
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.exiting(), 20.0, 1)
    registry.mark_ended(21.0)
    assert _view(registry)[:2] == (Ending.RELEASED, 20.0)


def test_an_unproven_release_is_no_end() -> None:
    registry = _registry()
    _record(registry, ev.RecordPhase.RELEASED, 1, 1.0, writer="manager")
    view = registry.view(SITE, DRONE)
    assert view is not None and view.record is not None
    registry.proof_key = None
    registry.apply_record_message(
        NS.record_key(SITE, DRONE),
        ev.encode(
            ev.DroneRecord(
                site=SITE,
                drone=DRONE,
                phase=ev.RecordPhase.RELEASED,
                writer="manager",
                at=dt.datetime.fromtimestamp(2.0, dt.UTC),
            )
        ),
        2,
        2.0,
    )
    _event(registry, FakeDrone(SITE, DRONE).exiting(), 3.0, 1)
    registry.mark_ended(4.0)
    assert _view(registry)[0] == ""


def test_deadline_expired_and_exiting_ends() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.started(), 1.0, 1)
    _record(registry, ev.RecordPhase.DEADLINE_EXPIRED, 1, 2.0)
    registry.mark_ended(3.0)
    assert _view(registry)[0] == ""
    _event(registry, drone.exiting(), 4.0, 2)
    registry.mark_ended(5.0)
    assert _view(registry)[:2] == (Ending.DEADLINE_EXPIRED, 4.0)


def test_tardis_down_ends_a_lost_drone_unless_its_agent_speaks_later() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.started(), 1.0, 1)
    _record(registry, ev.RecordPhase.UP, 1, 1.0)
    registry.mark_lost(1.0 + LOST)
    assert registry.metrics().lost == 1
    assert _note(registry, "BootingState", 2.0, 2) is Applied.APPLIED
    assert _note(registry, TARDIS_DOWN, 200.0, 5) is Applied.APPLIED
    registry.mark_ended(201.0)
    assert _view(registry) == (Ending.REMOVED, 200.0, False)
    assert (registry.metrics().lost, registry.metrics().ended) == (0, 1)
    # an event stored before the note, delivered late, changes nothing
    assert _event(registry, drone.heartbeat(), 150.0, 4) is Applied.APPLIED
    registry.mark_ended(202.0)
    assert _view(registry)[0] == Ending.REMOVED
    # a note stored before the agent's newest event never ended it
    registry2 = _registry()
    _event(registry2, drone.heartbeat(), 1.0, 10)
    assert _note(registry2, TARDIS_DOWN, 0.5, 9) is Applied.STALE
    registry2.mark_ended(2.0)
    assert _view(registry2)[0] == ""


def test_a_newer_event_clears_the_end_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry()
    drone = _drained_and_exited(registry)
    registry.mark_ended(12.0)
    with caplog.at_level(logging.INFO, REGISTRY_LOG):
        _event(registry, drone.started(), 13.0, 4)
    registry.mark_ended(14.0)
    assert _view(registry) == ("", None, False)
    assert any("spoke after its end" in r.getMessage() for r in caplog.records)
    assert registry.metrics().ended == 0


def test_a_drone_given_up_before_it_spoke_is_known_ended() -> None:
    registry = _registry()
    assert _note(registry, "BootingState", 1.0, 1) is Applied.STALE  # nothing to say
    assert registry.view(SITE, DRONE) is None
    assert _note(registry, TARDIS_DOWN, 2.0, 2) is Applied.APPLIED
    registry.mark_ended(3.0)
    assert _view(registry)[:2] == (Ending.REMOVED, 2.0)


def test_hostile_notes_are_counted_and_change_nothing() -> None:
    registry = _registry()
    note = ev.TardisState(
        site=SITE, drone=DRONE, state=TARDIS_DOWN, at=dt.datetime.now(dt.UTC), id="x"
    )
    other = NS.manager_note(SITE, "site1-0000000002", "tardis_state")
    assert registry.apply_note_message(ev.encode(note), other, 1.0, 1, {MSG_ID: "x"}) is (
        Applied.REJECTED
    )
    assert _note(registry, TARDIS_DOWN, 1.0, 2, **{"Nats-Stream": "X"}) is Applied.REJECTED
    subject = NS.manager_note(SITE, DRONE, "tardis_state")
    assert registry.apply_note_message(b"\xc1junk", subject, 1.0, 3, {}) is Applied.REJECTED
    assert registry.apply_note_message(ev.encode(note), subject, 1.0, 4, {}) is Applied.REJECTED
    assert registry.view(SITE, DRONE) is None
    assert registry.rejected[Rejection.SENDER] == 1
    assert registry.rejected[Rejection.RELAYED] == 2
    assert registry.rejected[Rejection.MALFORMED] == 1


def test_retirement_after_the_retention_and_only_if_still_ended() -> None:
    registry = _registry()
    drone = _drained_and_exited(registry)
    registry.mark_ended(12.0)
    assert registry.due_retirements(11.0 + 999) == []
    due = registry.due_retirements(11.0 + 1000)
    assert [v.drone for v in due] == [DRONE]
    _event(registry, drone.heartbeat(), 1012.0, 4)  # it spoke in between
    assert registry.retire(due[0]) is False
    assert registry.view(SITE, DRONE) is not None
    _event(registry, drone.exiting(), 1013.0, 5)
    registry.mark_ended(1014.0)
    due = registry.due_retirements(1013.0 + 1000)
    assert registry.retire(due[0]) is True
    assert registry.view(SITE, DRONE) is None and len(registry) == 0


def test_operator_lines_of_one_life(caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    with caplog.at_level(logging.INFO, REGISTRY_LOG):
        _event(registry, drone.started(), 1.0, 1)
        _record(registry, ev.RecordPhase.UP, 1, 1.0)
        _event(registry, drone.ready(), 2.0, 2)
        _event(registry, drone.payload_started("1.0"), 3.0, 3)
        _event(registry, drone.payload_finished("1.0"), 4.0, 4)
        _event(registry, drone.payload_started("2.0"), 5.0, 5)
        _record(registry, ev.RecordPhase.DRAINING, 2, 6.0, writer="manager")
        _record(registry, ev.RecordPhase.DRAINED, 3, 7.0)
        _event(registry, drone.exiting(), 8.0, 6)
        registry.mark_ended(9.0)
    said = [r.getMessage() for r in caplog.records if r.name == REGISTRY_LOG]
    assert said == [
        f"drone {SITE}/{DRONE} announced itself (agent_started, starting)",
        f"drone {SITE}/{DRONE} started its first payload",
        f"drone {SITE}/{DRONE} draining (record by the manager)",
        f"drone {SITE}/{DRONE} ended: drained",
    ]
    assert all(getattr(r, "drone", None) == DRONE for r in caplog.records)


def test_operator_lines_of_a_released_and_a_lost_drone(caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry()
    released = FakeDrone(SITE, DRONE)
    lost = FakeDrone(SITE, "site1-0000000002")
    with caplog.at_level(logging.INFO, REGISTRY_LOG):
        _event(registry, released.started(), 1.0, 1)
        _event(registry, lost.started(), 1.0, 2)
        _record(registry, ev.RecordPhase.RELEASED, 1, 2.0, writer="manager")
        _event(registry, released.exiting(), 3.0, 3)
        registry.mark_ended(4.0)
        registry.mark_lost(1.0 + LOST)
        registry.mark_ended(1.0 + LOST)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == REGISTRY_LOG]
    assert said == [
        ("INFO", f"drone {SITE}/{DRONE} announced itself (agent_started, starting)"),
        ("INFO", f"drone {SITE}/site1-0000000002 announced itself (agent_started, starting)"),
        ("INFO", f"drone {SITE}/{DRONE} released (record by the manager)"),
        ("INFO", f"drone {SITE}/{DRONE} ended: released"),
        ("WARNING", f"drone {SITE}/site1-0000000002 lost: no sign of life for {LOST:.0f}s"),
    ]


def test_mark_ended_looks_only_at_what_changed() -> None:
    registry = Registry(NS, lost_after_s=LOST)
    for number in range(200):
        drone = FakeDrone(SITE, f"site1-{number:010x}")
        _event(registry, drone.started(), 1.0, number + 1)
    registry.mark_ended(2.0)
    assert registry.pending_ends == 0  # the cost of the next tick
    drone = FakeDrone(SITE, "site1-0000000005")
    _event(registry, drone.heartbeat(), 3.0, 500)
    assert registry.pending_ends == 1
