"""The may-remove decision: which removals TARDIS may make, from a drone's view"""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest
from support.drones import FakeDrone
from support.registry import NS, PROOF_KEY, SITE, apply_event, make_record

from broker.manager.registry import Registry
from broker.manager.verdict import SAFE_REMOVALS, Removal, removal_verdict
from broker.manager.views import DroneView
from remote_agent.protocol import events as ev
from remote_agent.protocol.proof import record_proof

_PHASES: list[ev.RecordPhase | None] = [None, *ev.RecordPhase]


def _intent(duration_s: float) -> ev.DrainIntent:
    """A drain intent of ``duration_s``, written by a clock that is a year behind"""
    requested = dt.datetime(2025, 3, 18, tzinfo=dt.UTC)
    return ev.DrainIntent(
        deadline=requested + dt.timedelta(seconds=duration_s),
        requested_at=requested,
        request_id="r1",
    )


def _view(phase: ev.RecordPhase | None, writer: str, lost: bool) -> DroneView:
    """A drone last heard from at 1000 s; lost at 2000 s with lost_after 90 s"""
    registry = Registry(NS, lost_after_s=90)
    registry.proof_key = PROOF_KEY
    drone = FakeDrone(SITE, "site1-0000000001")
    apply_event(registry, drone.heartbeat(), 1000.0 if lost else 1950.0)
    if phase is not None:
        record = make_record(phase, writer)
        if phase is ev.RecordPhase.DEADLINE_EXPIRED:
            # a drain due at once, so that the agent's word is the manager's too
            record = msgspec.structs.replace(record, drain=_intent(0.0))
        if writer == "manager":
            record = msgspec.structs.replace(record, proof=record_proof(PROOF_KEY, record))
        # an agent's record is a sign of life of its own: keep it as old as the events
        registry.apply_record(record, 1, 1000.0 if lost else 1950.0)
    view = registry.view(SITE, drone.drone)
    assert view is not None
    return view


@pytest.mark.parametrize("lbs_running", [True, False, None])
@pytest.mark.parametrize("lost", [True, False])
@pytest.mark.parametrize("writer", ["agent", "manager"])
@pytest.mark.parametrize("phase", _PHASES)
def test_may_remove_truth_table(
    phase: ev.RecordPhase | None, writer: str, lost: bool, lbs_running: bool | None
) -> None:
    verdict = removal_verdict(_view(phase, writer, lost), lbs_running, 2000.0, 90.0)
    expected = (
        (phase is ev.RecordPhase.RELEASED and writer == "manager")
        or (phase is ev.RecordPhase.DRAINED and writer == "agent")
        or (phase is ev.RecordPhase.DEADLINE_EXPIRED and writer == "agent")
        or (lost and lbs_running is False)
    )
    assert verdict.allowed is expected, verdict
    assert bool(verdict) is expected
    assert (verdict.reason in SAFE_REMOVALS) is expected
    assert verdict.detail


def test_may_remove_reasons() -> None:
    def reason(phase: ev.RecordPhase | None, lost: bool, lbs: bool | None) -> Removal:
        return removal_verdict(_view(phase, "agent", lost), lbs, 2000.0, 90.0).reason

    assert removal_verdict(None, False, 2000.0, 90.0).reason is Removal.UNKNOWN_DRONE
    assert reason(None, False, False) is Removal.NOT_ANNOUNCED
    assert reason(ev.RecordPhase.UP, False, False) is Removal.AGENT_UP
    assert reason(ev.RecordPhase.DRAINING, False, False) is Removal.DRAINING
    assert reason(ev.RecordPhase.UP, True, True) is Removal.LOST_BUT_RUNNING
    assert reason(ev.RecordPhase.UP, True, None) is Removal.LOST_LBS_UNKNOWN
    assert reason(ev.RecordPhase.UP, True, False) is Removal.LOST_AND_NOT_RUNNING
    assert reason(ev.RecordPhase.DRAINED, False, True) is Removal.DRAINED_BY_AGENT
    assert reason(ev.RecordPhase.DEADLINE_EXPIRED, False, True) is Removal.DEADLINE_EXPIRED
    assert reason(ev.RecordPhase.RELEASED, False, True) is Removal.UNPROVEN_RELEASE


def test_never_seen_drone_is_not_lost() -> None:
    """Released by nobody and never heard from: release it, don't remove it"""
    registry = Registry(NS)
    registry.apply_record(make_record(ev.RecordPhase.DRAINING, "manager"), 1, 0.0)
    view = registry.view(SITE, "site1-0000000001")
    verdict = removal_verdict(view, False, 1e9, 90.0)
    assert not verdict.allowed
    assert verdict.reason is Removal.DRAINING
