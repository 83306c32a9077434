"""
TARDIS's own HTCondor site and batch-system adapters, wrapped, with a real nats-server and an
emulated HTCondor site: a drone drained instead of removed, a queued drone released, and the
fallback when the agent never reaches the bus
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.buses import BusFactory
from support.htcondor import HTCondorDrone, SiteFactory
from support.htcondor import htcondor_site as support_htcondor_site
from support.waiting import wait_until
from tardis.configuration.configuration import Configuration

from broker.emulation.groundtruth import read_ground_truth
from remote_agent.protocol import events as ev

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def htcondor_site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[SiteFactory]:
    """:func:`support.htcondor.htcondor_site`"""
    async with support_htcondor_site(tmp_path, monkeypatch) as start:
        yield start


def _lbs_events(tmp_path: Path) -> list[str]:
    return [entry["event"] for entry in read_ground_truth(tmp_path / "lbs.jsonl")]


async def test_tardis_htcondor_adapter_wrapped_lets_a_drone_drain_instead_of_removing_it(
    tmp_path: Path,
    make_bus: BusFactory,
    htcondor_site: SiteFactory,
) -> None:
    """
    A drone's whole life through TARDIS's own HTCondor adapters: submitted with
    condor_submit, seen running from its agent, let go by TARDIS while a payload
    runs, drained (the payload finishes), and gone by itself, so the adapters'
    condor_suspend/condor_rm never hit a running job
    """
    bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0, drain_deadline_s=60.0)
    lbs = await htcondor_site(0.5)
    tardis = HTCondorDrone.make(bus)

    async def claimed_and_busy() -> None:
        view = bus.registry.view("site1", tardis.uuid)
        assert view is not None and view.phase is ev.RecordPhase.UP  # the agent claimed it
        await wait_until(
            lambda: (
                (view := bus.registry.view("site1", tardis.uuid)) is not None
                and view.state is ev.DroneState.BUSY
            ),
            60,
            "a payload runs",
        )

    await tardis.let_go_in("AvailableState", before=claimed_and_busy)  # while the payload runs
    assert tardis.states.states[0] == "RequestState"
    assert tardis.site.counts["status_from_agent"] > 0
    view = bus.registry.view("site1", tardis.uuid)
    assert view is not None and view.phase is ev.RecordPhase.DRAINED
    events = _lbs_events(tmp_path)
    assert events[:2] == ["job_submitted", "job_started"]
    assert "job_removed" not in events and "job_suspended" not in events
    [ended] = [e for e in read_ground_truth(tmp_path / "lbs.jsonl") if e["event"] == "job_exited"]
    assert ended["returncode"] == 0 and ended["removed"] is False
    # every payload the startd started ran to its end
    [job] = lbs.jobs.values()
    startd = [e["event"] for e in read_ground_truth(job.sandbox / "ep" / "ground_truth.jsonl")]
    assert startd.count("payload_started") >= 1
    assert startd.count("payload_finished") == startd.count("payload_started")
    assert "payload_killed" not in startd


async def test_tardis_htcondor_adapter_wrapped_removes_a_drone_released_before_it_started(
    tmp_path: Path,
    make_bus: BusFactory,
    htcondor_site: SiteFactory,
) -> None:
    """TARDIS gives up a queued drone: the release wins, and condor_rm removes the idle job"""
    bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
    await htcondor_site(600.0)  # it stays queued
    tardis = HTCondorDrone.make(bus)
    # demand drops while the job waits in the queue (tardis#172, path 1)
    await tardis.let_go_in("BootingState")
    assert "CleanupState" in tardis.states.states
    view = bus.registry.view("site1", tardis.uuid)
    assert view is not None and view.phase is ev.RecordPhase.RELEASED  # the manager won
    assert tardis.site.counts["terminate_resource_allowed"] >= 1
    removed = [e for e in read_ground_truth(tmp_path / "lbs.jsonl") if e["event"] == "job_removed"]
    assert [e["was"] for e in removed] == ["idle"]  # condor_rm, parsed by TARDIS's adapter
    assert "job_started" not in _lbs_events(tmp_path)


async def test_tardis_htcondor_adapters_run_a_drone_whose_agent_never_reaches_the_bus(
    tmp_path: Path, make_bus: BusFactory, htcondor_site: SiteFactory
) -> None:
    """
    The fallback, with TARDIS's own HTCondor adapters doing all the work: condor_q,
    condor_status (with TARDIS's ratio expression), condor_drain, condor_suspend and
    condor_rm, each parsed by TARDIS. The agent cannot reach the bus, so it never
    opens the gate and no payload ever runs: the removal is safe.
    """
    # the drones are told a broker address where nobody listens
    bus = await make_bus(
        lost_after_s=10.0, request_timeout_s=2.0, drone_servers="nats://127.0.0.1:9"
    )
    lbs = await htcondor_site(0.5)
    Configuration().BatchSystem.max_age = 0.05  # minutes: 3 s, to keep the test short
    tardis = HTCondorDrone.make(bus)
    await tardis.let_go_in("AvailableState")
    assert "DrainingState" in tardis.states.states
    view = bus.registry.view("site1", tardis.uuid)
    assert view is not None and view.phase is ev.RecordPhase.RELEASED  # released by the drain
    assert tardis.site.counts["status_from_agent"] == 0
    assert tardis.batch.counts["get_machine_status_from_adapter"] > 0
    assert tardis.batch.counts["drain_machine_from_adapter"] >= 1
    assert not any(key.endswith("_failed") for key in tardis.batch.counts), tardis.batch.counts
    [job] = lbs.jobs.values()
    startd = [e["event"] for e in read_ground_truth(job.sandbox / "ep" / "ground_truth.jsonl")]
    assert "drain_requested" in startd  # TARDIS's condor_drain reached the startd
    assert "payload_started" not in startd  # the gate never opened
    # TARDIS's condor_suspend (ShutDownState) and condor_rm (CleanupState) took effect
    assert {"job_suspended", "job_removed"} <= set(_lbs_events(tmp_path))
