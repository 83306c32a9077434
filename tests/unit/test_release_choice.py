"""The release choice: never announced, idle, then fewest idle core-seconds while draining"""

from __future__ import annotations

import datetime as dt
import logging
import math
import sys
from typing import Any

import pytest
from support.tardis import (
    SITE,
    FakeControl,
    FakeOverlay,
    announce,
    no,
    offline_bus,
    with_control,
)
from tardis.agents.batchsystemagent import BatchSystemAgent

from broker.manager.registry import Registry
from broker.manager.verdict import Removal
from broker.manager.views import DroneView
from broker.tardis.release import DURATIONS_NEEDED, Durations, release_choice, work_left
from broker.tardis_adapter import RemoteBatchSystemAdapter, RemoteFactoryPool
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import dedupe_id

NOW = 1_800_000_000.0


def busy_view(
    registry: Registry,
    drone: str,
    ages_s: list[float],
    slots: int = 4,
    requested_s: float | None = None,
    ends_in_s: float | None = None,
) -> DroneView:
    """
    ``drone`` with payloads that started ``ages_s`` seconds before :data:`NOW`, each job ad
    asking for ``requested_s``, its batch job ending ``ends_in_s`` after :data:`NOW`
    """
    started = [dt.datetime.fromtimestamp(NOW - age, dt.UTC) for age in ages_s]
    at = dt.datetime.fromtimestamp(NOW, dt.UTC)
    snapshot = ev.Snapshot(
        state=ev.DroneState.BUSY if ages_s else ev.DroneState.IDLE,
        since=at,
        gate_open=True,
        slots=slots,
        payloads=[
            ev.Payload(job_id=f"{i}.0", started_at=s, requested_s=requested_s)
            for i, s in enumerate(started)
        ],
        started_at=at,
        end=ev.DroneEnd(in_s=ends_in_s, source="squeue") if ends_in_s is not None else None,
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
    registry.apply(event, registry.namespace.event(SITE, drone, "heartbeat"), NOW)
    view = registry.view(SITE, drone)
    assert view is not None
    return view


def test_the_estimate_is_the_mean_remaining_runtime_of_the_payloads_that_ran_as_long() -> None:
    durations = Durations()
    for d in (100.0, 200.0, 300.0, 400.0):
        durations.add(d)
    assert durations.left(50.0) is None  # too few ends seen: no estimate
    assert work_left(50.0, durations) == 50.0  # as long again as so far
    durations.add(1000.0)
    assert durations.left(0.0) == pytest.approx(400.0)
    assert durations.left(250.0) == pytest.approx((300 + 400 + 1000) / 3 - 250)
    assert durations.left(5000.0) == 0.0  # outlived every one seen
    assert work_left(250.0, durations, requested_s=300.0) == 50.0
    assert work_left(400.0, durations, requested_s=300.0) == 0.0


def test_a_drone_that_ends_soon_is_cheap_and_its_work_left_ends_with_it() -> None:
    """No payload runs past its drone's end: its work left, and the idle cores, stop there"""
    registry = Registry()
    # each payload asks for 1000 s and ran 100: 900 s left, were it not for the drone's end
    long_lived = busy_view(registry, "site1-0000000001", [100, 100], requested_s=1000.0)
    ending = busy_view(registry, "site1-0000000002", [100, 100], requested_s=1000.0, ends_in_s=60.0)
    far = release_choice(long_lived, 4.0, 0.0, now=NOW + 10)
    soon = release_choice(ending, 4.0, 0.0, now=NOW + 10)  # learned 10 s ago: 50 s left
    assert far.left_s == 890.0 and far.ends_in_s == math.inf
    assert soon.left_s == 50.0 and soon.ends_in_s == 50.0
    assert soon.idle_core_s == 2 * 50.0 and far.idle_core_s == 2 * 890.0
    assert soon < far
    assert soon.reason.endswith("its drone ends in 50s")
    # of two idle drones, the one whose batch job ends first goes first
    idle_far = busy_view(registry, "site1-0000000003", [], ends_in_s=3600.0)
    idle_soon = busy_view(registry, "site1-0000000004", [], ends_in_s=120.0)
    idle_never = busy_view(registry, "site1-0000000005", [])
    keys = {
        name: release_choice(view, 4.0, 0.0, now=NOW)
        for name, view in (("far", idle_far), ("soon", idle_soon), ("never", idle_never))
    }
    assert sorted(keys, key=keys.__getitem__) == ["soon", "far", "never"]
    assert keys["soon"].reason == "no payload runs, its drone ends in 120s"
    # a drone whose end has passed by the manager's clock: nothing left, never negative
    gone = release_choice(ending, 4.0, 0.0, now=NOW + 600)
    assert gone.left_s == 0.0 and gone.ends_in_s == 0.0 and gone.idle_core_s == 0.0


def test_the_order_is_never_announced_idle_then_fewest_idle_core_seconds() -> None:
    registry = Registry()
    durations = Durations()
    for _ in range(10):
        durations.add(1000.0)  # every payload runs 1000 s
    full = busy_view(registry, "site1-0000000001", [900, 900, 900, 900])  # 100 s left each
    half = busy_view(registry, "site1-0000000002", [900, 900])  # 2 slots idle for 100 s
    young = busy_view(registry, "site1-0000000003", [10, 10, 10, 10])  # 990 s left, none idle
    idle = busy_view(registry, "site1-0000000004", [])
    choices = {
        name: release_choice(view, 4.0, 0.0, durations, NOW)
        for name, view in {
            "full": full,
            "half": half,
            "young": young,
            "idle": idle,
            "never": None,
        }.items()
    }
    order = sorted(choices, key=choices.__getitem__)
    assert order == ["never", "idle", "full", "young", "half"]
    assert choices["half"].idle_core_s == pytest.approx(200.0)
    assert choices["young"].left_s == pytest.approx(990.0)
    assert choices["full"].reason == ("4 payload(s), about 100s left, 0 core-s idle while draining")


def test_the_runtime_a_payloads_ad_requests_counts_before_the_estimate() -> None:
    registry = Registry()
    durations = Durations()
    for _ in range(10):
        durations.add(1000.0)  # by the estimate, each has 100 s left
    soon = busy_view(registry, "site1-0000000001", [900] * 4, requested_s=920.0)
    late = busy_view(registry, "site1-0000000002", [900] * 4, requested_s=4000.0)
    guessed = busy_view(registry, "site1-0000000003", [900] * 4)
    choices = {
        name: release_choice(view, 4.0, 0.0, durations, NOW)
        for name, view in {"soon": soon, "late": late, "guessed": guessed}.items()
    }
    assert sorted(choices, key=lambda name: choices[name].left_s) == ["soon", "guessed", "late"]
    assert choices["soon"].left_s == pytest.approx(20.0)
    assert choices["late"].left_s == pytest.approx(3100.0)


def test_payload_ends_feed_the_estimate_as_the_registry_applies_them() -> None:
    registry = Registry()
    durations = Durations()
    registry.watchers.append(durations.seen)
    at = ev.utcnow()
    for seq in range(1, 4):
        event = ev.PayloadFinished(
            site=SITE,
            drone="site1-0000000001",
            incarnation="inc1",
            seq=seq,
            at=at,
            id=dedupe_id("site1-0000000001", "inc1", seq),
            snapshot=ev.Snapshot(state=ev.DroneState.IDLE, since=at, gate_open=True, started_at=at),
            job_id=f"{seq}.0",
            how=ev.PayloadEnd.EXIT,
            duration_s=60.0 * seq,
        )
        registry.apply(event, registry.namespace.event(SITE, event.drone, "payload_finished"), 1)
    announce(registry, "site1-0000000001", ev.DroneState.IDLE, seq=10)  # not an end
    assert len(durations) == 3


def _finished(drone: str, seq: int, duration_s: float, event_id: str = "") -> ev.PayloadFinished:
    at = ev.utcnow()
    return ev.PayloadFinished(
        site=SITE,
        drone=drone,
        incarnation="inc1",
        seq=seq,
        at=at,
        id=event_id or dedupe_id(drone, "inc1", seq),
        snapshot=ev.Snapshot(state=ev.DroneState.IDLE, since=at, gate_open=True, started_at=at),
        job_id=f"{seq}.0",
        how=ev.PayloadEnd.EXIT,
        duration_s=duration_s,
    )


def test_each_payload_end_counts_once() -> None:
    """The registry tells its watchers again of a drone whose newest event is an end"""
    registry = Registry()
    durations = Durations()
    registry.watchers.append(durations.seen)
    drone = "site1-0000000001"
    ns = registry.namespace
    told: list[str] = []
    registry.watchers.append(lambda view: told.append(view.kind))
    end = _finished(drone, 1, 60.0)
    registry.apply_message(ev.encode(end), ns.event(SITE, drone, "payload_finished"), 1.0, 1)
    note = ev.TardisState(site=SITE, drone=drone, state="IntegratingState", at=ev.utcnow(), id="n1")
    registry.apply_note_message(
        ev.encode(note), ns.manager_note(SITE, drone, "tardis_state"), 2.0, 2
    )
    record = ev.DroneRecord(
        site=SITE, drone=drone, phase=ev.RecordPhase.UP, writer="agent", at=ev.utcnow()
    )
    registry.apply_record(record, 1, 3.0)
    # the same end stored again under another id (an agent that published it anew)
    again = _finished(drone, 1, 60.0, event_id=f"{end.id}:0f3c")
    registry.apply_message(ev.encode(again), ns.event(SITE, drone, "payload_finished"), 4.0, 4)
    assert told == ["payload_finished"] * 4  # the watchers heard of this end four times
    assert len(durations) == 1
    registry.apply(_finished(drone, 2, 120.0), ns.event(SITE, drone, "payload_finished"), 5.0)
    assert len(durations) == 2


def test_no_number_a_drone_sends_makes_the_order_unsortable() -> None:
    """Ends of any finite length, and infinities given to the table, keep every key a number"""
    registry = Registry()
    durations = Durations()
    for duration_s in (math.inf, -math.inf, math.nan):
        durations.add(duration_s)
    assert len(durations) == 0
    for _ in range(DURATIONS_NEEDED):
        durations.add(sys.float_info.max)
    views = {
        name: busy_view(registry, f"site1-000000000{i}", ages, slots)
        for i, (name, ages, slots) in enumerate(
            [("one", [10], 2**64 - 1), ("two", [10, 20], 4), ("old", [1.7e9], 4)]
        )
    }
    for cores in (4.0, math.inf):
        choices = [release_choice(view, cores, math.nan, durations, NOW) for view in views.values()]
        for choice in choices:
            assert not any(
                math.isnan(key) for key in (choice.idle_core_s, choice.left_s, choice.base)
            )
        assert sorted(choices) == sorted(
            reversed(choices)
        )  # a total order: the input order is moot
    assert release_choice(None, 4.0, math.nan).base == math.inf


class Child:
    def __init__(self, drone: str) -> None:
        self.resource_attributes = {"drone_uuid": drone}
        self.demand = self.maximum_demand = 4.0
        self.supply = 4.0
        self.utilisation = 0.0


async def test_a_release_is_logged_with_its_reason_which_the_drain_carries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = offline_bus()
    announce(bus.registry, "site1-0000000001", ev.DroneState.BUSY, payloads=1)
    announce(bus.registry, "site1-0000000002", ev.DroneState.IDLE)
    children = [Child("site1-0000000001"), Child("site1-0000000002")]
    pool = RemoteFactoryPool(
        *children, factory=lambda: Child("site1-ffffffffff"), interval=1, bus=bus, site=SITE
    )
    with caplog.at_level(logging.INFO, "cobald.runtime.cobald_remote.tardis"):
        pool._shrink(target=4.0)
    assert [c.demand for c in children] == [4.0, 0]
    assert caplog.messages == ["site1/site1-0000000002 chosen for release: no payload runs"]

    reasons: list[Any] = []

    class Control(FakeControl):
        async def drain_or_release(self, site: str, drone: str, *args: Any, **kwargs: Any) -> Any:
            reasons.append(args[1] if len(args) > 1 else kwargs.get("reason"))
            return await super().drain_or_release(site, drone, *args, **kwargs)

    control = Control(no(Removal.AGENT_UP))
    agent = BatchSystemAgent(RemoteBatchSystemAdapter(FakeOverlay(), with_control(bus, control)))
    await agent.drain_machine(drone_uuid="site1-0000000002")
    await agent.drain_machine(drone_uuid="site1-0000000001")  # not chosen by the pool
    assert reasons == ["chosen for release: no payload runs", "TARDIS drain"]
    assert bus.release_reasons == {}
