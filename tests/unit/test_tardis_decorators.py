"""
The TARDIS decorators without a server: only TARDIS's handled exceptions escape,
answers come from the registry while facts are fresh, removal waits for may-remove
"""

from __future__ import annotations

import time

import pytest
from support.tardis import (
    DRONE,
    SITE,
    FakeControl,
    FakeOverlay,
    FakeSite,
    announce,
    attributes,
    no,
    offline_bus,
    with_control,
    yes,
)
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.exceptions.tardisexceptions import (
    TardisAuthError,
    TardisDroneCrashed,
    TardisError,
    TardisQuotaExceeded,
    TardisResourceStatusUpdateFailed,
    TardisTimeout,
)
from tardis.interfaces.batchsystemadapter import MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus

from broker.manager.verdict import Removal
from broker.tardis_adapter import (
    BusConfig,
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteSiteAdapter,
    TardisStateNotes,
    site_token,
)
from remote_agent.protocol import events as ev
from remote_agent.protocol.states import STARTING_STATES
from remote_agent.settings import Settings

#: what TARDIS's drone states handle from each site call (tardis/resources/dronestates.py,
#: 0.9.0): RequestState, the resource_status step, ShutDownState, CleanupState
HANDLED = {
    "deploy_resource": {
        TardisAuthError,
        TardisTimeout,
        TardisQuotaExceeded,
        TardisResourceStatusUpdateFailed,
        TardisDroneCrashed,
    },
    "resource_status": {
        TardisAuthError,
        TardisTimeout,
        TardisResourceStatusUpdateFailed,
        TardisDroneCrashed,
    },
    "stop_resource": {TardisResourceStatusUpdateFailed},
    "terminate_resource": {TardisResourceStatusUpdateFailed, TardisDroneCrashed},
}
FAILURES = [
    RuntimeError("boom"),
    OSError("connection reset"),
    KeyError("JobStatus"),
    ValueError("bad"),
    TardisError("adapter failed"),
    TardisTimeout(),
    TardisAuthError(),
    TardisDroneCrashed(),
    TardisQuotaExceeded(),
    TardisResourceStatusUpdateFailed(),
]


async def _call(agent: SiteAgent, call: str) -> None:
    await getattr(agent, call)(attributes())


async def _deferred(agent: SiteAgent, call: str, match: str) -> None:
    """A deferred removal: stop_resource raises, terminate_resource returns (Cleanup retries)"""
    if call == "terminate_resource":
        await _call(agent, call)
        return
    with pytest.raises(TardisResourceStatusUpdateFailed, match=match):
        await _call(agent, call)


@pytest.mark.parametrize("call", sorted(HANDLED))
@pytest.mark.parametrize("failure", FAILURES, ids=lambda e: type(e).__name__)
async def test_only_exceptions_tardis_handles_escape_a_site_call(
    call: str, failure: Exception
) -> None:
    inner = FakeSite(fail=failure, fail_on=frozenset(HANDLED))
    bus = with_control(offline_bus(), FakeControl(yes()))
    agent = SiteAgent(RemoteSiteAdapter(inner, bus))  # TARDIS's own agent, as in the daemon
    with pytest.raises(Exception) as raised:
        await _call(agent, call)
    assert type(raised.value) in HANDLED[call]
    if type(failure) in HANDLED[call]:
        assert raised.value is failure  # TARDIS's own reaction applies unchanged
    else:
        assert isinstance(raised.value, TardisResourceStatusUpdateFailed)
        assert raised.value.__cause__ is failure  # retried next heartbeat, cause kept


async def test_handle_exceptions_replaces_the_wrapped_adapters() -> None:
    adapter = RemoteSiteAdapter(FakeSite(), offline_bus())
    with pytest.raises(TardisResourceStatusUpdateFailed), adapter.handle_exceptions():
        raise TardisError("would abort the COBalD daemon")
    with pytest.raises(TardisTimeout), adapter.handle_exceptions():
        raise TardisTimeout()


@pytest.mark.parametrize("call", ["stop_resource", "terminate_resource"])
async def test_without_the_bus_nothing_is_removed(call: str) -> None:
    inner = FakeSite(status=ResourceStatus.Running)
    adapter = RemoteSiteAdapter(inner, offline_bus())
    await _deferred(SiteAgent(adapter), call, "not connected")
    assert inner.called(call) == 0
    assert adapter.counts[f"{call}_deferred"] == 1


@pytest.mark.parametrize("call", ["stop_resource", "terminate_resource"])
async def test_an_unannounced_drone_is_released_then_removed(call: str) -> None:
    inner = FakeSite(status=ResourceStatus.Booting)
    control = FakeControl(no(Removal.NOT_ANNOUNCED), yes())
    agent = SiteAgent(RemoteSiteAdapter(inner, with_control(offline_bus(), control)))
    await _call(agent, call)
    assert control.calls == ["may_remove", "release", "may_remove"]
    assert control.lbs == [True, True]  # queued counts as running: it may start any moment
    assert inner.called(call) == 1


@pytest.mark.parametrize("call", ["stop_resource", "terminate_resource"])
async def test_a_drone_whose_agent_is_up_is_drained_not_removed(call: str) -> None:
    inner = FakeSite(status=ResourceStatus.Running)
    control = FakeControl(no(Removal.AGENT_UP), no(Removal.DRAINING))
    agent = SiteAgent(RemoteSiteAdapter(inner, with_control(offline_bus(), control)))
    await _deferred(agent, call, "deferred")
    assert control.calls == ["may_remove", "drain", "may_remove"]
    assert inner.called(call) == 0


async def test_a_lost_drone_whose_job_runs_waits_for_its_deadline() -> None:
    bus = offline_bus(lost_after_s=5.0, lost_removal_after_s=60.0)
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=1, received=time.time() - 30)
    control = FakeControl(no(Removal.LOST_BUT_RUNNING))
    inner = FakeSite(status=ResourceStatus.Running)
    agent = SiteAgent(RemoteSiteAdapter(inner, with_control(bus, control)))
    await _deferred(agent, "stop_resource", r"may be removed in (29|30|31)s")
    await _deferred(agent, "terminate_resource", "")
    assert inner.called("stop_resource") == inner.called("terminate_resource") == 0
    # once silent for longer than lost_removal_after_s it may go
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=1, seq=2, received=time.time() - 61)
    bus.registry.mark_lost(time.time())
    await _call(agent, "terminate_resource")
    assert inner.called("terminate_resource") == 1


async def test_status_comes_from_the_agent_while_its_facts_are_fresh() -> None:
    bus = offline_bus(lost_after_s=10.0)
    inner = FakeSite(status=ResourceStatus.Booting)
    adapter = RemoteSiteAdapter(inner, bus)
    agent = SiteAgent(adapter)
    # never heard of: the wrapped adapter answers
    assert (await agent.resource_status(attributes())).resource_status is ResourceStatus.Booting
    # announced, its startd not taking work yet: Booting, whatever the site's view says
    inner.status = ResourceStatus.Running
    for seq, state in enumerate(sorted(STARTING_STATES), 1):
        announce(bus.registry, DRONE, state, seq=seq)
        answer = await agent.resource_status(attributes())
        assert answer.resource_status is ResourceStatus.Booting, state
    # its gate open: Running, without asking the site
    announce(bus.registry, DRONE, ev.DroneState.IDLE, seq=4)
    assert (await agent.resource_status(attributes())).resource_status is ResourceStatus.Running
    assert inner.called("resource_status") == 1
    inner.status = ResourceStatus.Booting
    # stale (silent for longer than lost_after_s): the wrapped adapter again
    announce(bus.registry, DRONE, ev.DroneState.IDLE, seq=5, received=time.time() - 11)
    assert (await agent.resource_status(attributes())).resource_status is ResourceStatus.Booting
    # the agent is exiting: its job ends, the site knows when
    announce(bus.registry, DRONE, ev.DroneState.EXITING, seq=6)
    inner.status = ResourceStatus.Deleted
    assert (await agent.resource_status(attributes())).resource_status is ResourceStatus.Deleted
    assert adapter.counts["status_from_agent"] == 4
    assert adapter.counts["status_from_adapter"] == 3


@pytest.mark.parametrize(
    ("state", "status"),
    [
        (ev.DroneState.STARTING, MachineStatus.NotAvailable),
        (ev.DroneState.WORKER_UP, MachineStatus.NotAvailable),
        (ev.DroneState.STARTD_READY, MachineStatus.NotAvailable),
        (ev.DroneState.IDLE, MachineStatus.Available),
        (ev.DroneState.BUSY, MachineStatus.Available),
        (ev.DroneState.DRAINING, MachineStatus.Draining),
        (ev.DroneState.DRAINED, MachineStatus.Drained),
        (ev.DroneState.RELEASED, MachineStatus.Drained),
        (ev.DroneState.EXITING, MachineStatus.Drained),
    ],
)
async def test_machine_status_comes_from_the_agent_available_once_its_gate_opened(
    state: ev.DroneState, status: MachineStatus
) -> None:
    bus = offline_bus(utilisation_hold_s=0)
    announce(bus.registry, DRONE, state, payloads=1 if state is ev.DroneState.BUSY else 0)
    inner = FakeOverlay(status=MachineStatus.NotAvailable)
    agent = BatchSystemAgent(RemoteBatchSystemAdapter(inner, bus))
    assert await agent.get_machine_status(drone_uuid=DRONE) is status
    busy = 0.5 if state is ev.DroneState.BUSY else 0.0
    assert await agent.get_utilisation(drone_uuid=DRONE) == busy
    assert await agent.get_allocation(drone_uuid=DRONE) == busy
    assert inner.calls == []


async def test_a_drone_answered_available_is_never_answered_not_available_again() -> None:
    """AvailableState and DrainingState go to ShutDownState on NotAvailable (a kill path)"""
    bus = offline_bus()
    agent = BatchSystemAgent(RemoteBatchSystemAdapter(FakeOverlay(), bus))
    announce(bus.registry, DRONE, ev.DroneState.STARTD_READY)
    assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.NotAvailable
    announce(bus.registry, DRONE, ev.DroneState.IDLE, seq=2)
    assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.Available
    # its agent restarts: a new incarnation starts again, its gate shut until it claims
    for seq, state in enumerate(sorted(STARTING_STATES), 3):
        announce(bus.registry, DRONE, state, seq=seq)
        assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.Available
    announce(bus.registry, DRONE, ev.DroneState.DRAINING, seq=6)
    assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.Draining
    announce(bus.registry, DRONE, ev.DroneState.STARTING, seq=7)
    assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.Draining


async def test_a_slot_whose_payload_ended_counts_busy_for_the_hold_then_not() -> None:
    """
    COBalD's LinearController lowers the demand for every step utilisation is below its
    floor: a slot the overlay pool has not yet given the next payload is not idle supply
    """
    bus = offline_bus(utilisation_hold_s=3600)
    agent = BatchSystemAgent(RemoteBatchSystemAdapter(FakeOverlay(), bus))
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=2)
    assert await agent.get_allocation(drone_uuid=DRONE) == 1.0
    announce(bus.registry, DRONE, ev.DroneState.IDLE, seq=2)  # both payloads ended
    assert await agent.get_utilisation(drone_uuid=DRONE) == 1.0
    assert await agent.get_allocation(drone_uuid=DRONE) == 1.0
    # a drone that drains takes no more work: what it runs is all it uses
    announce(bus.registry, DRONE, ev.DroneState.DRAINING, payloads=1, seq=3)
    assert await agent.get_utilisation(drone_uuid=DRONE) == 0.5
    announce(bus.registry, DRONE, ev.DroneState.DRAINED, seq=4)
    assert await agent.get_utilisation(drone_uuid=DRONE) == 0.0


async def test_a_drone_whose_gate_just_opened_neither_lowers_nor_raises_the_demand() -> None:
    """Whole utilisation (no step below the floor), its own allocation (none above the top)"""
    bus = offline_bus(utilisation_hold_s=3600)
    agent = BatchSystemAgent(RemoteBatchSystemAdapter(FakeOverlay(), bus))
    announce(bus.registry, DRONE, ev.DroneState.IDLE)
    assert await agent.get_utilisation(drone_uuid=DRONE) == 1.0
    assert await agent.get_allocation(drone_uuid=DRONE) == 0.0
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=1, seq=2)
    assert await agent.get_allocation(drone_uuid=DRONE) == 0.5


async def test_without_a_hold_a_freed_slot_is_free_at_once() -> None:
    bus = offline_bus(utilisation_hold_s=0)
    agent = BatchSystemAgent(RemoteBatchSystemAdapter(FakeOverlay(), bus))
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=2)
    assert await agent.get_utilisation(drone_uuid=DRONE) == 1.0
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=1, seq=2)
    assert await agent.get_utilisation(drone_uuid=DRONE) == 0.5


@pytest.mark.parametrize("failure", FAILURES, ids=lambda e: type(e).__name__)
async def test_batch_calls_never_raise(failure: Exception) -> None:
    inner = FakeOverlay(status=MachineStatus.Available)
    adapter = RemoteBatchSystemAdapter(inner, offline_bus())
    agent = BatchSystemAgent(adapter)
    # learn an answer first; a failing call then repeats it
    assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.Available
    inner.fail = failure
    assert await agent.get_machine_status(drone_uuid=DRONE) is MachineStatus.Available
    assert await agent.get_machine_status(drone_uuid="site1-ffffffffff") is (
        MachineStatus.NotAvailable
    )
    assert await agent.get_allocation(drone_uuid=DRONE) == 0.0
    assert await agent.get_utilisation(drone_uuid=DRONE) == 0.0
    await agent.drain_machine(drone_uuid=DRONE)  # offline bus: the OBS drain, which fails
    await agent.integrate_machine(drone_uuid=DRONE)
    await agent.disintegrate_machine(drone_uuid=DRONE)
    assert inner.called("drain_machine") == 1
    assert adapter.counts["drain_machine_failed"] == 1


async def test_drain_machine_is_the_self_drain() -> None:
    bus = offline_bus()
    announce(bus.registry, DRONE, ev.DroneState.BUSY, payloads=1)
    control = FakeControl(no(Removal.AGENT_UP))
    inner = FakeOverlay()
    adapter = RemoteBatchSystemAdapter(inner, with_control(bus, control))
    agent = BatchSystemAgent(adapter)
    await agent.drain_machine(drone_uuid=DRONE)
    assert control.calls == ["drain_or_release"]
    assert inner.called("drain_machine") == 0
    assert adapter.counts["drain_accepted"] == 1
    # announced, but its agent has not claimed: released, which its claim finds
    control.claimed = False
    await agent.drain_machine(drone_uuid=DRONE)
    assert control.calls == ["drain_or_release"] * 2
    assert inner.called("drain_machine") == 0
    assert adapter.counts["drain_not_announced"] == adapter.counts["drain_release_released"] == 1
    # a drone never heard of is released (or drained if its agent won the race), and
    # drained in the overlay pool in case its startd runs without an agent
    await agent.drain_machine(drone_uuid="site1-aaaaaaaaaa")
    assert control.calls == ["drain_or_release", "drain_or_release", "release"]
    assert inner.calls == [("drain_machine", "site1-aaaaaaaaaa")]


@pytest.mark.parametrize("domain", [None, "hub"])
async def test_the_drone_environment_carries_the_agents_settings(domain: str | None) -> None:
    bus = RemoteBus(
        BusConfig.from_mapping(
            {
                "servers": "nats://manager:4222",
                "drone_servers": ["nats://leaf1:4222", "nats://leaf2:4222"],
                "prefix": "tardis1",
                "domain": domain,
            }
        ),
        register=False,
    )
    inner = FakeSite()
    await SiteAgent(RemoteSiteAdapter(inner, bus)).deploy_resource(attributes())
    [environment] = inner.environments
    assert environment["Uuid"] == DRONE
    assert environment["Cores"] == 2
    # what TARDIS's site adapters export (prefix TardisDrone) is what the agent reads
    exported = {f"TardisDrone{key}": str(value) for key, value in environment.items()}
    settings = Settings.from_env(exported, worker_command=["condor_master", "-f"])
    assert (settings.drone, settings.site, settings.prefix) == (DRONE, SITE, "tardis1")
    assert settings.servers == ("nats://leaf1:4222", "nats://leaf2:4222")
    assert settings.domain == domain  # drones behind a leaf name the central domain


async def test_the_plugin_notes_states_and_never_raises() -> None:
    bus = offline_bus()
    plugin = TardisStateNotes(bus)

    class BootingState:
        def __str__(self) -> str:
            return "BootingState"

    await plugin.notify(BootingState(), attributes(resource_status=ResourceStatus.Booting))
    await plugin.notify(BootingState(), {"no": "drone uuid"})  # logged, not raised
    assert bus.tardis_states == {DRONE: "BootingState"}
    [note] = bus.pending_notes
    assert (note.site, note.drone, note.state, note.resource_status) == (
        SITE,
        DRONE,
        "BootingState",
        "Booting",
    )
    assert ev.decode_note(ev.encode(note)) == note


def test_site_names_become_subject_tokens() -> None:
    assert site_token("MySite") == "mysite"
    with pytest.raises(ValueError, match="site name"):
        site_token("my site")
