"""
Event-driven TARDIS drones with a real nats-server and TARDIS's own state machine: a drone
follows its agent's events without a heartbeat, bursts coalesce, and a drone without an
agent runs as TARDIS's stock drone does
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.js import JetStreamContext
from support.buses import BusFactory
from support.drones import publish
from support.tardis import SITE, drone_running, rig
from support.waiting import wait_until
from tardis.interfaces.batchsystemadapter import MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus
from tardis.resources.drone import Drone

from broker.tardis.drone import EventDrone

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
