"""
Event-driven TARDIS drones with a real nats-server and TARDIS's own state machine: a drone
follows its agent's events without a heartbeat, bursts coalesce, and a drone without an
agent runs as TARDIS's stock drone does
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from cobald.composite.factory import FactoryPool
from cobald.controller.linear import LinearController
from nats.js import JetStreamContext
from support.agent import FakeStartd, kinds, running, settings
from support.buses import BusFactory
from support.drones import publish
from support.tardis import SITE, drone_running, rig
from support.waiting import wait_until
from tardis.interfaces.batchsystemadapter import MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus
from tardis.resources.drone import Drone
from tardis.resources.dronestates import DrainState

from broker.server.embedded import EmbeddedServer
from broker.tardis.drone import EventDrone
from remote_agent.agent import Agent
from remote_agent.interfaces import JobStart
from remote_agent.protocol import events as ev

pytestmark = pytest.mark.timeout(120)


class HeldDrone(EventDrone):
    """An event drone whose state runs can be held at their end (before ``set_state``)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold: asyncio.Event | None = None
        self.held = asyncio.Event()

    async def set_state(self, state: Any) -> None:
        if self.hold is not None and self.state is not None:
            self.held.set()
            await self.hold.wait()
        await super().set_state(state)


async def test_a_drone_follows_its_agents_events_without_waiting_for_its_heartbeat(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    bus = await make_bus()
    one = rig(bus)
    drone, site, overlay, recorder, agent = (
        one.drone,
        one.site,
        one.overlay,
        one.recorder,
        one.agent,
    )
    async with drone_running(drone):
        await wait_until(lambda: recorder.states == ["RequestState", "BootingState"], 30, "Booting")
        assert drone.state_runs == 1  # the request; the heartbeat wait has begun
        await publish(js, bus.namespace, agent.started())
        await publish(js, bus.namespace, agent.ready())
        await wait_until(lambda: "AvailableState" in recorder.states, 30, "Available")
        assert recorder.states[2:] == ["IntegrateState", "IntegratingState", "AvailableState"]
        await wait_until(lambda: drone.supply == drone.maximum_demand, 30, "supply")
        # every answer since the request came from the agent's facts
        assert site.called("resource_status") == 0
        await publish(js, bus.namespace, agent.drained())
        await wait_until(lambda: "ShutDownState" in recorder.states, 30, "ShutDown")
    assert recorder.states[5:] == ["DisintegrateState", "ShutDownState"]
    # a drained agent ends its own job: TARDIS waits for that instead of suspending it
    assert site.called("stop_resource") == 0
    assert overlay.called("get_machine_status") == 0
    assert drone.woken >= 1


async def test_a_burst_of_events_during_a_state_run_leads_to_one_more_run(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    bus = await make_bus()
    one = rig(bus, cls=HeldDrone)
    drone, recorder, agent = one.drone, one.recorder, one.agent
    assert isinstance(drone, HeldDrone)
    uuid = drone.resource_attributes.drone_uuid
    async with drone_running(drone):
        await publish(js, bus.namespace, agent.started())
        await publish(js, bus.namespace, agent.ready())
        await wait_until(lambda: recorder.states[-1:] == ["AvailableState"], 30, "Available")
        await wait_until(lambda: drone.supply > 0, 30, "Available's own run")
        runs = drone.state_runs
        drone.hold = asyncio.Event()
        drone.held.clear()
        drone.wake()
        await asyncio.wait_for(drone.held.wait(), 30)  # a state run is under way
        burst = 20
        seq = 0
        for i in range(burst):  # each payload step changes the facts TARDIS reads
            event = (
                agent.payload_started(f"{i}.0")
                if i % 2 == 0
                else agent.payload_finished(f"{i - 1}.0")
            )
            seq = await publish(js, bus.namespace, event)
        await wait_until(
            lambda: (view := bus.registry.view(SITE, uuid)) is not None and view.stream_seq == seq,
            30,
            "the burst applied",
        )
        assert bus.waker.counts["wake_event"] >= burst
        drone.hold.set()
        drone.hold = None
        await wait_until(lambda: drone.state_runs >= runs + 2, 30, "the run after the burst")
        # no further run follows: nothing changed since (no busy loop)
        await asyncio.sleep(0.5)
        assert drone.state_runs == runs + 2
        assert recorder.states[-1] == "AvailableState"


async def test_a_drone_without_an_agent_runs_as_tardis_stock_drone(make_bus: BusFactory) -> None:
    """Same script, a stock Drone and an EventDrone side by side: same states, same calls"""
    bus = await make_bus()
    rigs = [
        rig(bus, cls=cls, heartbeat_s=1, overlay=MachineStatus.Available)
        for cls in (Drone, EventDrone)
    ]
    stock, evented = drones = [r.drone for r in rigs]
    sites = [r.site for r in rigs]
    overlays = [r.overlay for r in rigs]
    recorders = [r.recorder for r in rigs]
    async with drone_running(stock) as stock_task, drone_running(evented) as event_task:
        await wait_until(
            lambda: all("BootingState" in r.states for r in recorders), 30, "both Booting"
        )
        for site in sites:  # the site starts both jobs; no agent ever speaks
            site.status = ResourceStatus.Running
        await wait_until(
            lambda: all("AvailableState" in r.states for r in recorders), 30, "both Available"
        )
        for drone in drones:
            drone.demand = 0  # COBalD releases both
        await asyncio.wait_for(asyncio.gather(stock_task, event_task), 60)
    assert recorders[0].states == recorders[1].states
    assert recorders[1].states[-1] == "DownState"
    assert [c for c, _ in sites[0].calls] == [c for c, _ in sites[1].calls]
    assert [c for c, _ in overlays[0].calls] == [c for c, _ in overlays[1].calls]
    assert evented.woken == 0  # the release wrote its record; nobody announced: no wake
    assert bus.waker.counts["wake_event"] == 0


async def ran_since_now(drone: Any) -> None:
    """Wait for a state run that began after this call (it saw the registry as it is now)"""
    runs = drone.state_runs
    drone.wake()
    # the run under way now, if any, may have read older facts; the one after it cannot
    await wait_until(lambda: drone.state_runs >= runs + 1, 30, "a state run")
    drone.wake()
    await wait_until(lambda: drone.state_runs >= runs + 2, 30, "a state run after it")


async def test_a_drone_is_supply_only_once_its_startd_can_take_work(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    bus = await make_bus()
    one = rig(bus)
    drone, site, recorder, agent = one.drone, one.site, one.recorder, one.agent
    uuid = drone.resource_attributes.drone_uuid
    async with drone_running(drone):
        await wait_until(lambda: recorder.states == ["RequestState", "BootingState"], 30, "Booting")
        # the job runs and its agent has announced itself, but the startd takes no work yet
        for event in (agent.started(), agent.worker_up(), agent.startd_ready()):
            await publish(js, bus.namespace, event)
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.STARTD_READY
            ),
            30,
            "startd_ready at the manager",
        )
        await ran_since_now(drone)
        assert recorder.states == ["RequestState", "BootingState"]
        assert drone.supply == 0.0  # not counted in COBalD's utilisation and allocation
        # the claim opened its gate: TARDIS follows at once, without the site
        await publish(js, bus.namespace, agent.gate_opened())
        await wait_until(lambda: drone.supply == drone.maximum_demand, 30, "Available's run")
        assert recorder.states[2:] == ["IntegrateState", "IntegratingState", "AvailableState"]
        assert site.called("resource_status") == 0


async def test_cobald_releases_a_drone_whose_startd_takes_no_work_yet_before_its_gate_opens(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    """TARDIS's BootingState follows COBalD's release (IntegratingState would not)"""
    bus = await make_bus()
    one = rig(bus)
    drone, site, recorder, agent = one.drone, one.site, one.recorder, one.agent
    uuid = drone.resource_attributes.drone_uuid
    async with drone_running(drone) as task:
        await wait_until(lambda: "BootingState" in recorder.states, 30, "Booting")
        for event in (agent.started(), agent.worker_up(), agent.startd_ready()):
            await publish(js, bus.namespace, event)
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.STARTD_READY
            ),
            30,
            "startd_ready at the manager",
        )
        drone.demand = 0  # COBalD releases it (its release wakes it)
        await asyncio.wait_for(task, 60)
    assert recorder.states[1:] == ["BootingState", "CleanupState", "DownState"]
    # the release won the handshake: its agent's claim finds it released, its gate never
    # opens; the job was removed, with nothing on it
    control = bus.control
    assert control is not None
    claimed = await control.store.claim(SITE, uuid, agent.incarnation)
    assert (claimed.record.phase, claimed.record.writer) == (ev.RecordPhase.RELEASED, "manager")
    assert site.called("terminate_resource") == 1


async def test_a_starting_drone_does_not_pull_cobalds_demand_down(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    """Nine busy drones and one whose startd takes no work yet, under COBalD's own objects"""
    bus = await make_bus()
    rigs = [rig(bus) for _ in range(10)]
    busy, starting = rigs[:9], rigs[9]
    async with contextlib.AsyncExitStack() as running:
        for one in rigs:
            await running.enter_async_context(drone_running(one.drone))
        for one in busy:
            for event in (one.agent.started(), one.agent.worker_up(), one.agent.ready()):
                await publish(js, bus.namespace, event)
            for job in range(4):  # every slot busy
                await publish(js, bus.namespace, one.agent.payload_started(f"{job}.0"))
        await wait_until(
            lambda: all(o.drone.supply > 0 and o.drone.utilisation == 1.0 for o in busy),
            60,
            "nine busy drones Available",
        )
        pool = FactoryPool(*(o.drone for o in busy), factory=lambda: rig(bus).drone)
        controller = LinearController(pool, low_utilisation=0.9, high_allocation=0.9)
        before = pool.utilisation
        assert before == pool.allocation == 1.0
        # the tenth drone's job runs, its agent is up, its startd takes no work yet
        pool._hatchery.add(starting.drone)
        for event in (
            starting.agent.started(),
            starting.agent.worker_up(),
            starting.agent.startd_ready(),
        ):
            await publish(js, bus.namespace, event)
        uuid = starting.drone.resource_attributes.drone_uuid
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.STARTD_READY
            ),
            30,
            "startd_ready at the manager",
        )
        await ran_since_now(starting.drone)
        assert starting.recorder.states[-1] == "BootingState"
        assert pool.utilisation >= before and pool.allocation >= before
        demand = pool.demand
        controller.regulate(1.0)
        assert pool.demand > demand  # allocation above 0.9: more, never less
        # once it can take work it is supply, its slots empty: for bus.utilisation_hold_s, until
        # the overlay pool had a negotiation cycle to fill them, it lowers no demand (whole
        # utilisation) and raises none (its own allocation, nothing allocated yet)
        await publish(js, bus.namespace, starting.agent.gate_opened())
        await wait_until(lambda: starting.drone.supply > 0, 30, "the tenth drone Available")
        assert pool.utilisation == 1.0
        assert pool.allocation == pytest.approx(0.9)
        demand = pool.demand
        controller.regulate(1.0)
        assert pool.demand == demand  # neither below low_utilisation nor above high_allocation


async def test_a_drain_before_the_agents_claim_is_honoured_by_its_claim(
    make_bus: BusFactory, js: JetStreamContext, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """
    TARDIS drains a drone (restored in DrainState, as its SQLite registry restores one)
    whose agent is up but has not claimed its record: its startd is not ready yet
    """
    bus = await make_bus()
    startd = FakeStartd()
    startd.is_ready = False
    uuid = f"{SITE}-00000000d1"
    agent = Agent(settings(tmp_path, nats_server.url, uuid, startd=True), startd=startd)
    async with running(agent) as run:
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.WORKER_UP
            ),
            30,
            "the agent up, its startd not ready",
        )
        one = rig(bus, uuid, heartbeat_s=1)
        drone, site, recorder = one.drone, one.site, one.recorder
        site.status = ResourceStatus.Running
        await drone.set_state(DrainState())
        await DrainState.run(drone)  # TARDIS's drain_machine, then DrainingState
        # the drain is in the record for the claim to find: the drone is released
        control = bus.control
        assert control is not None
        record = await control.store.read(SITE, uuid)
        assert record is not None and record.record.phase is ev.RecordPhase.RELEASED
        async with drone_running(drone) as task:
            startd.is_ready = True  # the startd comes up: the agent claims its record
            assert await run.exit_code(60) == 0
            await asyncio.wait_for(task, 60)
    assert recorder.states[-1] == "DownState"
    assert one.overlay.called("drain_machine") == 0  # its agent is heard: no OBS drain
    # the claim found the drone released: its gate never opened, no payload may start
    events = await kinds(js, uuid)
    assert "released" in events and "gate_opened" not in events
    assert not agent.prepare_job(JobStart(job_id="1.0", slot="slot1_1")).allow
