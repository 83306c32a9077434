"""
A drone's own words against the end tracker: whatever it repeats or flips, the tracker's
schedules stay bounded by the drones it knows, and what it ends it retires on time
"""

from __future__ import annotations

import datetime as dt

from support.drones import FakeDrone

from broker.manager.lifecycle import Ending
from broker.manager.registry import Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import MSG_ID, Namespace

NS = Namespace()
SITE = "site1"
RETAIN = 1000.0
LOST = 90.0


def _event(registry: Registry, event: ev.Event, at: float, seq: int) -> None:
    subject = NS.event(event.site, event.drone, ev.kind_of(type(event)))
    registry.apply_message(ev.encode(event), subject, at, seq, {MSG_ID: event.id})


def _drained(registry: Registry, drone: str, at: float) -> None:
    record = ev.DroneRecord(
        site=SITE,
        drone=drone,
        phase=ev.RecordPhase.DRAINED,
        writer="agent",
        at=dt.datetime.fromtimestamp(at, dt.UTC),
    )
    registry.apply_record(record, 1, at)


def _scheduled(registry: Registry) -> int:
    ends = registry._ends  # the size of its schedules is the property
    return len(ends._retire) + len(ends._silence)


def test_a_drone_repeating_its_exit_keeps_one_retirement_scheduled() -> None:
    """Every ``exiting`` moves the end later; it must not add a schedule each time"""
    registry = Registry(NS, lost_after_s=LOST, retain_ended_s=RETAIN)
    drone = FakeDrone(SITE, "site1-00000000e1")
    _drained(registry, drone.drone, 0.0)
    at = 1.0
    for seq in range(1, 2001):
        at += 5.0
        _event(registry, drone.exiting(), at, seq)
        registry.mark_ended(at)
    view = registry.view(SITE, drone.drone)
    assert view is not None and view.ended == Ending.DRAINED and view.ended_time == at
    assert _scheduled(registry) <= 2
    # retired at its newest end's retention, not before
    assert registry.due_retirements(at + RETAIN - 1) == []
    assert [v.drone for v in registry.due_retirements(at + RETAIN)] == [drone.drone]


def test_a_drone_flipping_in_and_out_of_its_end_keeps_its_schedules_bounded() -> None:
    registry = Registry(NS, lost_after_s=LOST, retain_ended_s=RETAIN)
    drones = [FakeDrone(SITE, f"site1-{n:010x}") for n in range(20)]
    for drone in drones:
        _drained(registry, drone.drone, 0.0)
    at, seq = 1.0, 0
    for _ in range(100):
        for kind in ("exiting", "heartbeat"):
            at += 5.0
            for drone in drones:
                seq += 1
                _event(registry, getattr(drone, kind)(), at, seq)
            registry.mark_ended(at)
    assert _scheduled(registry) <= 3 * len(drones)
    # the last word of each was a heartbeat after a drained record: it ends by silence
    registry.mark_ended(at + LOST)
    assert sorted(v.drone for v in registry.due_retirements(at + LOST + RETAIN)) == sorted(
        d.drone for d in drones
    )
