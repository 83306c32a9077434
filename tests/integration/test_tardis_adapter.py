"""
The TARDIS decorators with a real nats-server, real TARDIS drones and real agent processes:
the fallback to the wrapped adapters, self-drain, and a lost agent's removal deadline
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from support.buses import BusFactory, Transitions
from support.drones import FakeDrone, publish
from support.metrics import scrape
from support.processes import CLI, pid_exists, start_process
from support.tardis import SITE, FakeOverlay, FakeSite, attributes
from support.waiting import wait_until
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.interfaces.batchsystemadapter import MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus
from tardis.resources.drone import Drone
from tardis.utilities.attributedict import AttributeDict

from broker.manager.timeline import read_timeline
from broker.server.embedded import EmbeddedServer
from broker.tardis_adapter import (
    RemoteBatchSystemAdapter,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace

pytestmark = pytest.mark.timeout(180)


class Agent:
    """``cobald-remote agent run --no-startd`` as a real process, stopped by its PID"""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, tmp_path: Path, url: str, drone: str) -> Agent:
        log = (tmp_path / f"agent-{drone}.log").open("wb")
        proc = await start_process(
            *CLI,
            "agent",
            "run",
            "--no-startd",
            f"--url={url}",
            f"--drone={drone}",
            "--heartbeat=1",
            "--end-grace=1",
            "--kill-after=2",
            f"--spool-dir={tmp_path / ('spool-' + drone)}",
            "--",
            "sleep",
            "300",
            stdout=log,
            stderr=log,
        )
        log.close()
        return cls(proc)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        assert not pid_exists(self.proc.pid) or self.proc.returncode is not None


async def test_a_drone_whose_agent_never_connects_is_run_by_the_wrapped_adapters(
    tmp_path: Path, make_bus: BusFactory, nats_server: EmbeddedServer
) -> None:
    bus = await make_bus(lost_after_s=5.0)
    site = FakeSite(status=ResourceStatus.Booting)
    overlay = FakeOverlay(status=MachineStatus.Available)
    site_adapter = RemoteSiteAdapter(site, bus)
    recorder = Transitions()
    drone = Drone(  # the real TARDIS drone and state machine
        site_agent=SiteAgent(site_adapter),
        batch_system_agent=BatchSystemAgent(RemoteBatchSystemAdapter(overlay, bus)),
        plugins=[TardisStateNotes(bus), recorder],
    )
    uuid = drone.resource_attributes.drone_uuid
    task = asyncio.create_task(drone.run())
    try:
        await wait_until(lambda: "BootingState" in recorder.states, 30, "Booting")
        site.status = ResourceStatus.Running  # the site starts the job; no agent ever speaks
        await wait_until(lambda: "AvailableState" in recorder.states, 30, "Available")
        drone.demand = 0  # COBalD releases it
        await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert recorder.states == [
        "RequestState",
        "BootingState",
        "IntegrateState",
        "IntegratingState",
        "AvailableState",
        "DrainState",
        "DrainingState",
        "DisintegrateState",
        "ShutDownState",
        "ShuttingDownState",
        "CleanupState",
        "DownState",
    ]
    # every answer came from the wrapped adapters; the drain was a release and an OBS drain
    assert site_adapter.counts["status_from_agent"] == 0
    assert [site.called(c) for c in ("stop_resource", "terminate_resource")] == [1, 1]
    assert overlay.called("drain_machine") == 1
    view = bus.registry.view(SITE, uuid)
    assert view is not None and view.record is not None
    assert (view.record.phase, view.record.writer) == (ev.RecordPhase.RELEASED, "manager")

    # the job starts late after all: its agent finds the drone released and runs nothing
    agent = await Agent.start(tmp_path, nats_server.url, uuid)
    try:
        assert await asyncio.wait_for(agent.proc.wait(), 60) == 0
    finally:
        await agent.stop()
    nc = await nats.connect(nats_server.url)
    try:

        async def rows() -> list[Any]:
            return await read_timeline(nc, bus.namespace, uuid)

        await wait_until(lambda: bus.counts["notes_published"] >= 12, 30, "notes published")
        timeline = await rows()
    finally:
        await nc.close()
    events = [r.drone_event.split(":")[0] for r in timeline if r.source == "agent"]
    assert "released" in events and "gate_opened" not in events
    tardis = [
        r.tardis_state.removeprefix("-> ").split(" ")[0] for r in timeline if r.source == "tardis"
    ]
    assert tardis == recorder.states
    # the manager's registry consumes events only: TARDIS's notes are not rejected
    assert bus.registry.metrics().rejected_total == 0


async def terminate_when_allowed(
    site_agent: SiteAgent, site: FakeSite, ra: AttributeDict, limit_s: float
) -> tuple[int, float]:
    """
    Call terminate_resource every 0.25 s, as TARDIS's CleanupState does, until it removes

    A deferred termination returns without removing (CleanupState retries either way).

    :returns: how often it was deferred, and when (epoch) the removing call began
    """
    deferred, started = 0, time.monotonic()
    while True:
        attempt = time.time()
        await site_agent.terminate_resource(ra)
        if site.called("terminate_resource"):
            return deferred, attempt
        deferred += 1
        assert time.monotonic() - started < limit_s, "never removed"
        await asyncio.sleep(0.25)


async def test_an_announced_drone_is_drained_and_removed_once_drained(
    tmp_path: Path, make_bus: BusFactory, nats_server: EmbeddedServer
) -> None:
    bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
    uuid = "site1-00000000a1"
    agent = await Agent.start(tmp_path, nats_server.url, uuid)
    try:
        await wait_until(
            lambda: (
                bus.registry.view(SITE, uuid) is not None
                and bus.registry.view(SITE, uuid).state is ev.DroneState.IDLE
            ),  # type: ignore[union-attr]
            60,
            "the agent is up with its gate open",
        )
        phases: list[ev.RecordPhase | None] = []

        class WatchedSite(FakeSite):
            async def terminate_resource(self, resource_attributes: Any) -> None:
                view = bus.registry.view(SITE, uuid)
                phases.append(None if view is None else view.phase)
                await super().terminate_resource(resource_attributes)

        site = WatchedSite(status=ResourceStatus.Booting)  # the site's view lags: still queued
        site_agent = SiteAgent(RemoteSiteAdapter(site, bus))
        ra = attributes(uuid)
        assert (await site_agent.resource_status(ra)).resource_status is ResourceStatus.Running
        assert site.called("resource_status") == 0
        # TARDIS wants it gone: a drain, not a removal. Nothing runs on it, so the
        # agent drains at once and ends its job; TARDIS retries until it may remove.
        # Whether the first try already finds the drained record is up to timing.
        await terminate_when_allowed(site_agent, site, ra, 60)
        assert phases == [ev.RecordPhase.DRAINED], "removed only once the agent drained"
        assert await asyncio.wait_for(agent.proc.wait(), 60) == 0
    finally:
        await agent.stop()


async def test_a_drone_whose_agent_drained_and_exited_goes_down_without_touching_its_job(
    tmp_path: Path, make_bus: BusFactory, nats_server: EmbeddedServer
) -> None:
    """The site's cached view still says Running; the final record says the job is over"""
    bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
    uuid = "site1-00000000c3"
    agent = await Agent.start(tmp_path, nats_server.url, uuid)
    try:
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.IDLE
            ),
            60,
            "the agent is up with its gate open",
        )
        site = FakeSite(status=ResourceStatus.Running)
        overlay = FakeOverlay(status=MachineStatus.Available)
        site_adapter = RemoteSiteAdapter(site, bus)
        recorder = Transitions()
        drone = Drone(
            site_agent=SiteAgent(site_adapter),
            batch_system_agent=BatchSystemAgent(RemoteBatchSystemAdapter(overlay, bus)),
            plugins=[TardisStateNotes(bus), recorder],
            drone_uuid=uuid,
        )
        task = asyncio.create_task(drone.run())
        try:
            await wait_until(lambda: "AvailableState" in recorder.states, 30, "Available")
        finally:
            task.cancel()
        # the operator drains it; nothing runs, so its agent drains and ends its job
        control = bus.control
        assert control is not None
        await control.drain(SITE, uuid, reason="operator")
        assert await asyncio.wait_for(agent.proc.wait(), 60) == 0
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.EXITING
                and view.phase is ev.RecordPhase.DRAINED
            ),
            30,
            "the agent's last event and its drained record",
        )
        await asyncio.wait_for(drone.run(), 30)  # TARDIS goes on: Available, then Down
    finally:
        await agent.stop()
    assert recorder.states[-2:] == ["AvailableState", "DownState"]
    assert [site.called(c) for c in ("stop_resource", "terminate_resource")] == [0, 0]
    assert site_adapter.counts["status_from_record"] == 1


async def test_a_lost_agent_whose_job_runs_is_not_removed_before_the_deadline(
    tmp_path: Path, make_bus: BusFactory, nats_server: EmbeddedServer
) -> None:
    removal_after_s, drain_s = 8.0, 6.0
    bus = await make_bus(
        lost_after_s=3.0,
        lost_removal_after_s=removal_after_s,
        drain_deadline_s=drain_s,
        request_timeout_s=0.5,
    )
    uuid = "site1-00000000b2"
    agent = await Agent.start(tmp_path, nats_server.url, uuid)
    try:
        await wait_until(
            lambda: (
                (view := bus.registry.view(SITE, uuid)) is not None
                and view.state is ev.DroneState.IDLE
            ),
            60,
            "the agent is up",
        )
        os.kill(agent.proc.pid, signal.SIGSTOP)  # hangs: no heartbeat, no answer
        await wait_until(lambda: bus.fresh(SITE, uuid) is None, 30, "lost")
        site = FakeSite(status=ResourceStatus.Running)  # the site still runs the job
        site_agent = SiteAgent(RemoteSiteAdapter(site, bus))
        ra = attributes(uuid)
        # no longer fresh: the wrapped adapter answers again
        assert (await site_agent.resource_status(ra)).resource_status is ResourceStatus.Running
        deferred, attempt = await terminate_when_allowed(site_agent, site, ra, 90)
        view = bus.registry.view(SITE, uuid)
        assert view is not None and view.last_seen is not None and view.record is not None
        assert view.record.drain is not None  # the intent waits for the agent's return
        assert attempt >= view.last_seen + removal_after_s
        assert attempt >= view.record.drain.deadline.timestamp()
        assert deferred >= 5
        assert site.called("terminate_resource") == 1
    finally:
        await agent.stop()


async def test_the_bus_serves_metrics_of_what_it_consumed(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    """``bus.metrics``: the manager's counters on /metrics, from a real stream"""
    bus = await make_bus(metrics="127.0.0.1:0")
    assert bus.metrics is not None
    await wait_until(lambda: bus.metrics is not None and bus.metrics.port != 0, 10, "bound")
    ns = Namespace()
    drones = [FakeDrone("site1", f"site1-{n:010x}") for n in range(3)]
    for drone in drones:
        for event in (drone.started(), drone.ready()):
            await publish(js, ns, event)
    await publish(js, ns, drones[0].payload_started("1.0"))
    await js.publish(ns.event("site1", drones[1].drone, "heartbeat"), b"\xc1")  # malformed
    await wait_until(lambda: bus.manager.consumer_stats.acked >= 7, 30, "consumed")
    await wait_until(lambda: bus.manager.consumer_stats.termed >= 1, 30, "rejected")
    samples = await scrape(bus.metrics.port)
    assert samples[("cobald_remote_connected", ())] == 1
    assert samples[("cobald_remote_registry_events_total", (("outcome", "applied"),))] == 7
    assert samples[("cobald_remote_registry_rejected_total", (("reason", "malformed"),))] == 1
    assert samples[("cobald_remote_consumer_messages_total", (("outcome", "acked"),))] == 7
    assert samples[("cobald_remote_consumer_messages_total", (("outcome", "termed"),))] == 1
    assert samples[("cobald_remote_drones", (("site", "site1"), ("state", "busy")))] == 1
    assert samples[("cobald_remote_drones", (("site", "site1"), ("state", "idle")))] == 2
    assert samples[("cobald_remote_rebuild_seconds", ())] >= 0
    assert ("cobald_remote_tardis_notes_buffered", ()) in samples


async def test_a_recorded_drain_reads_draining_before_the_agent_says_so(
    make_bus: BusFactory, js: JetStreamContext
) -> None:
    """No DrainState/DrainingState flip: the drain TARDIS asked for answers ``Draining``"""
    bus = await make_bus(lost_after_s=60.0, request_timeout_s=0.5)
    drone = FakeDrone(SITE, "site1-00000000a7")
    for event in (drone.started(), drone.ready()):
        await publish(js, Namespace(), event)
    assert bus.control is not None
    await bus.control.store.claim(SITE, drone.drone, drone.incarnation)
    await wait_until(
        lambda: (
            (view := bus.registry.view(SITE, drone.drone)) is not None
            and view.state is ev.DroneState.IDLE
            and view.phase is ev.RecordPhase.UP
        ),
        what="the drone idle with its record claimed",
    )
    overlay = FakeOverlay()
    batch = RemoteBatchSystemAdapter(overlay, bus)
    assert await batch.get_machine_status(drone.drone) is MachineStatus.Available
    # DrainState's call: recorded; the agent (this fake answers no command) has said nothing
    await batch.drain_machine(drone.drone)
    view = bus.registry.view(SITE, drone.drone)
    assert view is not None and view.state is ev.DroneState.IDLE
    assert view.phase is ev.RecordPhase.DRAINING
    # DrainingState's look at it: not Available, which would send it back to DrainState
    assert await batch.get_machine_status(drone.drone) is MachineStatus.Draining
    assert overlay.calls == []  # the agent is heard from: the overlay pool is not asked
