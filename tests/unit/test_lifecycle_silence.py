"""
Drones that never end, retired after ``retain_lost_s``: lost ones, and releases of drones
that never spoke; measured by the server's times only, never a drone's (injected clock)
"""

from __future__ import annotations

import datetime as dt
import logging
import time

import pytest
from support.drones import FakeDrone
from support.tardis import FakeSite, announce, attributes, offline_bus
from tardis.agents.siteagent import SiteAgent
from tardis.interfaces.siteadapter import ResourceStatus

from broker.manager import lifecycle
from broker.manager.lifecycle import forgotten_at, least_retain_lost_s, quiet_since
from broker.manager.registry import Applied, Registry
from broker.manager.verdict import Removal, removal_verdict, up_without_record
from broker.manager.views import DroneView
from broker.tardis_adapter import RemoteSiteAdapter
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import MSG_ID, Namespace
from remote_agent.protocol.proof import record_proof
from remote_agent.protocol.ratelog import RateLimitedLog

NS = Namespace()
SITE = "site1"
DRONE = "site1-00000000c1"
OTHER = "site1-00000000c2"
KEY = b"k" * 32
LOST = 90.0
RETAIN_LOST = 10_000.0


@pytest.fixture(autouse=True)
def _every_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No line held back by another test's"""
    monkeypatch.setattr(lifecycle, "lines", RateLimitedLog(lifecycle.log, interval_s=0.0))


def _registry(retain_lost_s: float = RETAIN_LOST) -> Registry:
    registry = Registry(NS, lost_after_s=LOST, retain_ended_s=1000.0, retain_lost_s=retain_lost_s)
    registry.proof_key = KEY
    return registry


def _event(registry: Registry, event: ev.Event, at: float, seq: int) -> Applied:
    subject = NS.event(event.site, event.drone, ev.kind_of(type(event)))
    return registry.apply_message(ev.encode(event), subject, at, seq, {MSG_ID: event.id})


def _released(registry: Registry, at: float | None, drone: str = DRONE) -> None:
    """A forced release: the manager's proven record, no agent"""
    record = ev.DroneRecord(
        site=SITE,
        drone=drone,
        phase=ev.RecordPhase.RELEASED,
        writer="manager",
        at=dt.datetime.fromtimestamp(at or 0.0, dt.UTC),
    )
    record = ev.DroneRecord(
        **{f: getattr(record, f) for f in record.__struct_fields__ if f != "proof"},
        proof=record_proof(KEY, record),
    )
    assert registry.apply_record(record, 1, at) is Applied.APPLIED


def _tick(registry: Registry, now: float) -> list[str]:
    """What the manager's liveness tick does, up to retirement; the drones it retires"""
    registry.mark_ended(now)
    registry.mark_lost(now)
    retired = []
    for view in registry.due_retirements(now):
        assert registry.retire(view)
        retired.append(view.drone)
    return retired


def _lost(registry: Registry, drone: FakeDrone, at: float) -> None:
    _event(registry, drone.started(), at, 1)
    _event(registry, drone.heartbeat(), at, 2)


def test_a_lost_drone_is_retired_after_retain_lost_s_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _registry()
    _lost(registry, FakeDrone(SITE, DRONE), 100.0)
    assert _tick(registry, 100.0 + LOST) == []
    assert registry.metrics().lost == 1
    assert _tick(registry, 100.0 + RETAIN_LOST - 1) == []
    with caplog.at_level(logging.INFO, logger="cobald.runtime.cobald_remote.registry"):
        assert _tick(registry, 100.0 + RETAIN_LOST) == [DRONE]
        assert _tick(registry, 100.0 + 2 * RETAIN_LOST) == []
    assert registry.view(SITE, DRONE) is None
    assert registry.metrics().lost == 0
    lines = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    assert lines == [
        f"drone {SITE}/{DRONE} retired without an end: lost, and nothing came of it since "
        "1970-01-01T00:01:40+00:00 (bus.retain_lost_s 10000s)"
    ]


def test_a_drone_that_speaks_again_is_kept() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _lost(registry, drone, 100.0)
    assert _tick(registry, 100.0 + LOST) == []  # lost
    _event(registry, drone.heartbeat(), 5000.0, 3)  # back before the bound
    assert _tick(registry, 100.0 + RETAIN_LOST) == []
    assert registry.view(SITE, DRONE) is not None
    assert _tick(registry, 5000.0 + RETAIN_LOST) == [DRONE]


def test_a_late_heartbeat_delivered_out_of_order_counts_too() -> None:
    """The newest heartbeat the stream stored keeps the drone, whatever order it came in"""
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.started(), 100.0, 5)
    beat = drone.heartbeat()
    assert _event(registry, beat, 6000.0, 3) is Applied.STALE  # older seq, newer time
    assert _tick(registry, 100.0 + RETAIN_LOST) == []
    assert _tick(registry, 6000.0 + RETAIN_LOST) == [DRONE]


def test_forged_event_times_do_not_bring_it_forward() -> None:
    """Silence is the server's clock of receipt: an event claiming the distant past or
    future changes nothing"""
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    drone.clock = dt.datetime(1971, 1, 1, tzinfo=dt.UTC)
    _event(registry, drone.started(), 100.0, 1)
    drone.clock = dt.datetime(2999, 1, 1, tzinfo=dt.UTC)
    _event(registry, drone.heartbeat(), 200.0, 2)
    view = registry.view(SITE, DRONE)
    assert view is not None and quiet_since(view) == 200.0
    assert _tick(registry, 200.0 + RETAIN_LOST - 1) == []
    assert _tick(registry, 200.0 + RETAIN_LOST) == [DRONE]


def test_no_drone_makes_another_forgotten() -> None:
    """A drone's event on another's subject is rejected; another's life moves nothing here"""
    registry = _registry()
    _lost(registry, FakeDrone(SITE, DRONE), 5000.0)
    other = FakeDrone(SITE, OTHER)
    _event(registry, other.started(), 100.0, 10)
    forged = FakeDrone(SITE, DRONE).heartbeat()
    subject = NS.event(SITE, OTHER, "heartbeat")
    assert registry.apply_message(ev.encode(forged), subject, 150.0, 11) is Applied.REJECTED
    assert _tick(registry, 100.0 + RETAIN_LOST) == [OTHER]
    assert _tick(registry, 5000.0 + RETAIN_LOST - 1) == []
    assert _tick(registry, 5000.0 + RETAIN_LOST) == [DRONE]


def test_a_forced_release_of_a_drone_that_never_spoke_retires_after_retain_lost_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _registry()
    _released(registry, 100.0)
    assert _tick(registry, 100.0 + 1000.0 * 5) == []  # not ended: retain_ended_s is not it
    view = registry.view(SITE, DRONE)
    assert view is not None and not view.ended and not view.lost
    with caplog.at_level(logging.INFO, logger="cobald.runtime.cobald_remote.registry"):
        assert _tick(registry, 100.0 + RETAIN_LOST) == [DRONE]
    assert "retired without an end: its agent never spoke" in caplog.text


def test_a_record_not_yet_confirmed_is_not_forgotten() -> None:
    """The manager's own write, merged before the KV watch confirms it: no time yet"""
    registry = _registry()
    _lost(registry, FakeDrone(SITE, DRONE), 100.0)
    _released(registry, None)
    assert _tick(registry, 100.0 + 10 * RETAIN_LOST) == []
    view = registry.view(SITE, DRONE)
    assert view is not None and forgotten_at(view, RETAIN_LOST) is None


def test_an_ended_drone_retires_on_its_own_schedule_only() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.exiting(), 100.0, 1)
    _released(registry, 100.0)
    assert _tick(registry, 100.0 + 999.0) == []
    assert _tick(registry, 100.0 + 1000.0) == [DRONE]  # retain_ended_s after its end


def test_a_view_that_changed_after_it_was_offered_is_not_retired() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _lost(registry, drone, 100.0)
    registry.mark_ended(100.0)
    (offered,) = registry.due_retirements(100.0 + RETAIN_LOST)
    assert registry.retirable(offered)
    _event(registry, drone.heartbeat(), 100.0 + RETAIN_LOST, 3)
    assert not registry.retirable(offered) and not registry.retire(offered)
    assert _tick(registry, 100.0 + RETAIN_LOST + 1) == []


def test_zero_never_retires_and_no_bound_is_below_lost_after_s() -> None:
    registry = _registry(retain_lost_s=0)
    _lost(registry, FakeDrone(SITE, DRONE), 100.0)
    _released(registry, 100.0, drone=OTHER)
    assert _tick(registry, 1e12) == []
    for wrong in (-1.0, float("inf"), float("nan"), 1.0, LOST - 1):
        with pytest.raises(ValueError, match="retain_lost_s must be 0"):
            Registry(NS, lost_after_s=LOST, retain_lost_s=wrong)
    shortest = Registry(NS, lost_after_s=LOST, retain_lost_s=least_retain_lost_s(LOST))
    _lost(shortest, FakeDrone(SITE, DRONE), 100.0)
    assert _tick(shortest, 100.0 + LOST - 1) == []  # between two heartbeats: kept
    assert _tick(shortest, 100.0 + LOST) == [DRONE]


def test_a_drone_back_without_its_record_is_never_released() -> None:
    """Retired while away, it comes back with payloads: no verdict lets them be killed"""
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _lost(registry, drone, 100.0)
    assert _tick(registry, 100.0 + RETAIN_LOST) == [DRONE]
    back = 100.0 + RETAIN_LOST + 5
    _event(registry, drone.ready(), back, 3)
    _event(registry, drone.payload_started("job.1"), back, 4)
    view = registry.view(SITE, DRONE)
    assert view is not None and view.record is None and up_without_record(view)
    for lbs in (True, None, False):
        verdict = removal_verdict(view, lbs, back + 1, LOST)
        assert (verdict.allowed, verdict.reason) == (False, Removal.RECORD_TAMPERED)
    # still starting (no gate, no payload): the ordinary race, a release may win it
    fresh = FakeDrone(SITE, OTHER)
    _event(registry, fresh.started(), back, 1)
    assert not up_without_record(registry.view(SITE, OTHER))
    assert removal_verdict(registry.view(SITE, OTHER), True, back, LOST).reason is (
        Removal.NOT_ANNOUNCED
    )


async def test_tardis_asking_for_a_retired_drone_gets_the_wrapped_adapters_answer() -> None:
    """Stock TARDIS's answer, never an end the manager decided on (no Deleted of its own)"""
    bus = offline_bus(lost_after_s=10.0, retain_lost_s=100.0)
    inner = FakeSite(status=ResourceStatus.Running)
    adapter = RemoteSiteAdapter(inner, bus)
    registry = bus.registry
    now = time.time()
    announce(registry, "site1-0123456789", ev.DroneState.BUSY, payloads=1, received=now - 101)
    assert _tick(registry, now) == ["site1-0123456789"]
    answer = await SiteAgent(adapter).resource_status(attributes())
    assert answer.resource_status is ResourceStatus.Running
    assert (adapter.counts["status_from_adapter"], adapter.counts["status_from_record"]) == (1, 0)


def test_never_before_the_deadline_of_a_drain_its_record_holds() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _lost(registry, drone, 100.0)
    deadline = dt.datetime.fromtimestamp(100.0 + 3 * RETAIN_LOST, dt.UTC)
    requested = dt.datetime.fromtimestamp(100.0, dt.UTC)
    intent = ev.DrainIntent(deadline=deadline, requested_at=requested, request_id="r1")
    record = ev.DroneRecord(
        site=SITE,
        drone=DRONE,
        phase=ev.RecordPhase.DRAINING,
        writer="agent",
        incarnation=drone.incarnation,
        drain=intent,
        at=dt.datetime.fromtimestamp(100.0, dt.UTC),
    )
    assert registry.apply_record(record, 1, 100.0) is Applied.APPLIED
    assert _tick(registry, 100.0 + 2 * RETAIN_LOST) == []
    assert _tick(registry, 100.0 + 3 * RETAIN_LOST) == [DRONE]


def test_the_liveness_tick_looks_at_due_and_changed_drones_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fleet whose drones all speak costs a tick nothing per drone; each is lost on time"""
    registry = _registry()
    drones = [FakeDrone(SITE, f"{SITE}-{i:010x}") for i in range(200)]
    for i, drone in enumerate(drones):
        _event(registry, drone.started(), 100.0 + i / 100, 1)
    _tick(registry, 102.0)  # every view changed: each is looked at once
    looked: list[str] = []
    counts_lost = DroneView.counts_lost

    def counted(view: DroneView, now: float, lost_after_s: float) -> bool:
        looked.append(view.drone)
        return counts_lost(view, now, lost_after_s)

    monkeypatch.setattr(DroneView, "counts_lost", counted)
    _tick(registry, 100.0 + LOST - 1)
    assert looked == []  # nothing changed, nothing due
    _event(registry, drones[5].heartbeat(), 150.0, 2)  # one speaks: its silence moves
    _tick(registry, 100.0 + LOST - 0.5)
    assert looked == []
    _tick(registry, 100.0 + LOST + 0.095)  # the first ten fall silent for LOST, on time
    lost = {v.drone for v in registry.views().values() if v.lost}
    assert lost == {d.drone for d in drones[:10] if d is not drones[5]}
    assert sorted(looked) == sorted(d.drone for d in drones[:10])  # drone 5's old time too


def test_a_lost_drone_that_speaks_is_not_lost_and_is_lost_again_after_its_new_silence() -> None:
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _lost(registry, drone, 100.0)
    _tick(registry, 100.0 + LOST)
    assert registry.view(SITE, DRONE).lost  # type: ignore[union-attr]
    _event(registry, drone.heartbeat(), 500.0, 3)
    _tick(registry, 501.0)
    assert not registry.view(SITE, DRONE).lost  # type: ignore[union-attr]
    _tick(registry, 500.0 + LOST - 1)
    assert not registry.view(SITE, DRONE).lost  # type: ignore[union-attr]
    _tick(registry, 500.0 + LOST)
    assert registry.view(SITE, DRONE).lost  # type: ignore[union-attr]


def test_a_late_heartbeat_of_a_lost_drone_brings_it_back() -> None:
    """A heartbeat older by seq but newer by receipt replaces the heartbeat facts only"""
    registry = _registry()
    drone = FakeDrone(SITE, DRONE)
    _event(registry, drone.started(), 100.0, 5)
    _tick(registry, 100.0 + LOST)
    assert registry.view(SITE, DRONE).lost  # type: ignore[union-attr]
    assert _event(registry, drone.heartbeat(), 400.0, 3) is Applied.STALE
    _tick(registry, 401.0)
    assert not registry.view(SITE, DRONE).lost  # type: ignore[union-attr]
    _tick(registry, 400.0 + LOST)
    assert registry.view(SITE, DRONE).lost  # type: ignore[union-attr]
