"""
What the TARDIS decorators tell TARDIS and the operator, with real TARDIS drones and states:
failures logged once per drone and cause, pending removals without TARDIS's warnings,
and the final record's answer once a drone's agent has ended
"""

from __future__ import annotations

import logging
import time

import pytest
from support.clock import FakeClock
from support.tardis import (
    DRONE,
    SITE,
    FakeControl,
    FakeOverlay,
    FakeSite,
    announce,
    no,
    offline_bus,
    with_control,
    yes,
)
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.interfaces.siteadapter import ResourceStatus
from tardis.resources.drone import Drone
from tardis.resources.dronestates import (
    AvailableState,
    CleanupState,
    DownState,
    RequestState,
    ShutDownState,
)

from broker.manager.verdict import Removal
from broker.tardis.failures import CallLog
from broker.tardis_adapter import (
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.protocol import events as ev

TARDIS_LOG = "cobald.runtime.tardis.resources.dronestates"
OUR_LOG = "cobald.runtime.cobald_remote.tardis"


def _drone(site: FakeSite, bus: RemoteBus) -> Drone:
    """A real TARDIS drone (and state machine) behind the decorators"""
    return Drone(
        site_agent=SiteAgent(RemoteSiteAdapter(site, bus)),
        batch_system_agent=BatchSystemAgent(RemoteBatchSystemAdapter(FakeOverlay(), bus)),
        plugins=[TardisStateNotes(bus)],
        drone_uuid=DRONE,
    )


def _lines(caplog: pytest.LogCaptureFixture, name: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == level]


async def test_a_failing_submit_is_logged_once_per_drone_and_cause_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    bus = offline_bus()
    clock = FakeClock()
    bus.call_log = CallLog(logging.getLogger(OUR_LOG), 300.0, clock)
    missing = FileNotFoundError(2, "No such file or directory", "condor_submit")
    site = FakeSite(fail=missing, fail_on=frozenset({"deploy_resource"}))
    drone = _drone(site, bus)
    await drone.set_state(RequestState())
    await RequestState.run(drone)  # TARDIS's own state: it gives the drone up, silently
    assert isinstance(drone.state, DownState)
    warnings = _lines(caplog, OUR_LOG, logging.WARNING)
    assert warnings == [
        f"deploy_resource of {DRONE} failed: FileNotFoundError: [Errno 2] No such file or "
        "directory: 'condor_submit'; TARDIS gives the drone up"
    ]
    tracebacks = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info[1] is missing  # type: ignore[index]
    # the same cause again: held back, then counted
    adapter = drone.site_agent._site_adapter
    for _ in range(37):
        await RequestState.run(drone)
    assert len(_lines(caplog, OUR_LOG, logging.WARNING)) == 1
    clock.now = 301.0
    await RequestState.run(drone)
    last = _lines(caplog, OUR_LOG, logging.WARNING)[-1]
    assert last.endswith("(and 37 more like it in the last 301s)")
    # another cause is news at once
    site.fail = RuntimeError("condor_submit: exit code 1")
    await RequestState.run(drone)
    assert (
        "RuntimeError: condor_submit: exit code 1" in _lines(caplog, OUR_LOG, logging.WARNING)[-1]
    )
    assert adapter.counts["deploy_resource_failed"] == 40


async def test_a_failing_status_call_is_logged_and_tardis_asks_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    site = FakeSite(
        fail=OSError("condor_q: connection refused"), fail_on=frozenset({"resource_status"})
    )
    drone = _drone(site, offline_bus())
    await drone.set_state(AvailableState())
    await AvailableState.run(drone)
    assert isinstance(drone.state, AvailableState)  # dronestates.py:72-74
    assert _lines(caplog, OUR_LOG, logging.WARNING) == [
        f"resource_status of {DRONE} failed: OSError: condor_q: connection refused; "
        "TARDIS asks again next heartbeat"
    ]


async def test_a_pending_removal_says_why_once_per_reason_and_tardis_warns_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    bus = with_control(offline_bus(), FakeControl(no(Removal.AGENT_UP)))
    control = bus.control
    assert isinstance(control, FakeControl)
    site = FakeSite(status=ResourceStatus.Running)
    drone = _drone(site, bus)
    await drone.set_state(ShutDownState())
    for _ in range(5):  # five heartbeats while the agent drains
        await ShutDownState.run(drone)
        assert isinstance(drone.state, ShutDownState)
    control.verdicts = [no(Removal.DRAINING)]
    for _ in range(5):
        await ShutDownState.run(drone)
    assert site.called("stop_resource") == 0
    assert _lines(caplog, TARDIS_LOG, logging.WARNING) == []  # no "Calling stop_resource failed"
    assert _lines(caplog, OUR_LOG, logging.INFO) == [
        f"stop_resource of {SITE}/{DRONE} deferred: test: no (agent_up)",
        f"stop_resource of {SITE}/{DRONE} deferred: test: no (draining)",
    ]
    control.verdicts = [yes(Removal.DRAINED_BY_AGENT)]
    await ShutDownState.run(drone)
    assert site.called("stop_resource") == 1
    assert str(drone.state) == "ShuttingDownState"


async def test_a_pending_termination_keeps_cleanup_without_tardis_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    bus = with_control(offline_bus(), FakeControl(no(Removal.DRAINING)))
    site = FakeSite(status=ResourceStatus.Stopped)
    drone = _drone(site, bus)
    await drone.set_state(CleanupState())
    for _ in range(3):
        await CleanupState.run(drone)
        assert isinstance(drone.state, CleanupState)
    assert site.called("terminate_resource") == 0
    assert _lines(caplog, TARDIS_LOG, logging.WARNING) == []  # no "Will retry later!"
    assert _lines(caplog, OUR_LOG, logging.INFO) == [
        f"terminate_resource of {SITE}/{DRONE} deferred: test: no (draining)"
    ]
    control = bus.control
    assert isinstance(control, FakeControl)
    control.verdicts = [yes(Removal.DEADLINE_EXPIRED)]
    await CleanupState.run(drone)
    assert site.called("terminate_resource") == 1


def _final(bus: RemoteBus, phase: ev.RecordPhase, state: ev.DroneState, age_s: float) -> None:
    announce(bus.registry, DRONE, ev.DroneState.IDLE, received=time.time() - age_s - 1)
    announce(bus.registry, DRONE, state, seq=2, received=time.time() - age_s)
    record = ev.DroneRecord(site=SITE, drone=DRONE, phase=phase, writer="agent", at=ev.utcnow())
    bus.registry.apply_record(record, 2, time.time() - age_s)


@pytest.mark.parametrize("phase", [ev.RecordPhase.DRAINED, ev.RecordPhase.DEADLINE_EXPIRED])
@pytest.mark.parametrize(
    ("state", "age_s"), [(ev.DroneState.EXITING, 0.0), (ev.DroneState.DRAINED, 60.0)]
)
async def test_after_its_agent_ended_a_drone_is_deleted_by_its_record(
    phase: ev.RecordPhase, state: ev.DroneState, age_s: float
) -> None:
    bus = with_control(offline_bus(lost_after_s=30.0), FakeControl(yes()))
    _final(bus, phase, state, age_s)
    site = FakeSite(status=ResourceStatus.Running)  # the site's cached view: stale
    drone = _drone(site, bus)
    await drone.set_state(AvailableState())
    await AvailableState.run(drone)
    # Deleted: DownState at once, no suspend or removal of a job that is gone
    assert isinstance(drone.state, DownState)
    assert [call for call, _ in site.calls] == []
    assert drone.site_agent._site_adapter.counts["status_from_record"] == 1


@pytest.mark.parametrize(
    ("phase", "state", "age_s"),
    [
        (ev.RecordPhase.UP, ev.DroneState.EXITING, 0.0),  # not final: the site knows
        (ev.RecordPhase.DRAINED, ev.DroneState.DRAINED, 0.0),  # drained, agent still up
        (ev.RecordPhase.DRAINING, ev.DroneState.DRAINING, 60.0),  # lost while draining
    ],
)
async def test_without_a_final_record_and_an_ended_agent_the_answer_is_not_the_records(
    phase: ev.RecordPhase, state: ev.DroneState, age_s: float
) -> None:
    bus = offline_bus(lost_after_s=30.0)
    _final(bus, phase, state, age_s)
    adapter = RemoteSiteAdapter(FakeSite(status=ResourceStatus.Running), bus)
    answer = await SiteAgent(adapter).resource_status(_drone(FakeSite(), bus).resource_attributes)
    assert answer.resource_status is ResourceStatus.Running
    assert adapter.counts["status_from_record"] == 0


async def test_a_drone_whose_agent_never_came_is_not_deleted_by_its_release() -> None:
    bus = offline_bus(lost_after_s=30.0)
    record = ev.DroneRecord(
        site=SITE, drone=DRONE, phase=ev.RecordPhase.RELEASED, writer="manager", at=ev.utcnow()
    )
    bus.registry.apply_record(record, 1, time.time() - 600)
    site = FakeSite(status=ResourceStatus.Booting)  # still queued: it must be removed
    adapter = RemoteSiteAdapter(site, bus)
    answer = await SiteAgent(adapter).resource_status(_drone(FakeSite(), bus).resource_attributes)
    assert answer.resource_status is ResourceStatus.Booting
    assert site.called("resource_status") == 1
