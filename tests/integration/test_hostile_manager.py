"""
A drone lying to the manager, with its own credentials, on a real nats-server

Each test does what a process holding one drone's credentials can do (publish
its own events and records, with any body and headers) and checks that the
manager neither lets that drone be removed while its payloads run, nor loses
later true events, nor disagrees with itself after a restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from support.drones import FakeDrone
from support.hostile import (
    DRONE,
    NS,
    RECORD_SUBJECT,
    SITE,
    as_drone,
    manager,
    publish,
    write_record,
)
from support.servers import drone_creds
from support.tardis import FakeSite, attributes
from support.waiting import wait_until
from tardis.agents.siteagent import SiteAgent
from tardis.exceptions.tardisexceptions import TardisResourceStatusUpdateFailed
from tardis.interfaces.siteadapter import ResourceStatus

from broker.manager.outcomes import ReleaseOutcome
from broker.manager.rebuild import rebuild
from broker.manager.registry import Registry
from broker.manager.service import ManagerService
from broker.manager.timeline import read_timeline
from broker.manager.verdict import Removal
from broker.server.embedded import EmbeddedServer
from broker.tardis_adapter import BusConfig, RemoteBus, RemoteSiteAdapter
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.proof import PROOF_KEY

pytestmark = pytest.mark.timeout(120)


async def busy_and_up(nc: Client) -> FakeDrone:
    """The drone announces itself, claims its record and runs two payloads"""
    drone = FakeDrone(SITE, DRONE)
    for event in (drone.started(), drone.ready()):
        await publish(nc, event)
    record = ev.DroneRecord(
        site=SITE, drone=DRONE, phase=ev.RecordPhase.UP, writer="agent", at=ev.utcnow()
    )
    await write_record(nc, RECORD_SUBJECT, ev.encode(record))
    await publish(nc, drone.payload_started("1.0"))
    await publish(nc, drone.payload_started("2.0"))
    return drone


def _busy(service: ManagerService) -> bool:
    view = service.registry.view(SITE, DRONE)
    return view is not None and len(view.payloads) == 2 and view.record is not None


async def test_a_drone_writing_the_managers_release_is_not_removable(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = drone_creds(tmp_path, authority, SITE, DRONE)
    async with (
        as_drone(server.url, creds) as nc,
        manager(server.url, tmp_path / "manager.creds") as service,
    ):
        await busy_and_up(nc)
        await wait_until(lambda: _busy(service), what="busy drone with a record")
        forged = ev.DroneRecord(
            site=SITE,
            drone=DRONE,
            phase=ev.RecordPhase.RELEASED,
            writer="manager",
            at=ev.utcnow(),
            proof=b"\x00" * 32,
        )
        await write_record(nc, RECORD_SUBJECT, ev.encode(forged))
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, DRONE)) is not None
                and view.phase is ev.RecordPhase.RELEASED
            ),
            what="the forged record seen",
        )
        control = service.control
        assert control is not None
        verdict = control.may_remove(SITE, DRONE, lbs_running=True)
        assert (verdict.allowed, verdict.reason) == (False, Removal.UNPROVEN_RELEASE)
        result = await control.release(SITE, DRONE, note="demand dropped")
        assert result.outcome is not ReleaseOutcome.RELEASED and not result.may_remove
        assert not control.may_remove(SITE, DRONE, lbs_running=True)
    # and a restarted manager reads it the same way
    async with manager(server.url, tmp_path / "manager.creds") as restarted:
        assert restarted.control is not None
        verdict = restarted.control.may_remove(SITE, DRONE, lbs_running=True)
        assert (verdict.allowed, verdict.reason) == (False, Removal.UNPROVEN_RELEASE)


@pytest.mark.parametrize("operation", ["DEL", "PURGE"])
async def test_a_drone_deleting_its_record_is_never_released_over_it(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], operation: str
) -> None:
    server, authority = secured
    creds = drone_creds(tmp_path, authority, SITE, DRONE)
    async with as_drone(server.url, creds) as nc:
        async with manager(server.url, tmp_path / "manager.creds") as service:
            await busy_and_up(nc)
            await wait_until(lambda: _busy(service), what="busy drone with a record")
            await nc.jetstream().publish(RECORD_SUBJECT, b"", headers={"KV-Operation": operation})
            await wait_until(
                lambda: (
                    (view := service.registry.view(SITE, DRONE)) is not None
                    and view.record is not None
                    and view.record.tampered != ""
                ),
                what="the removal seen",
            )
        # a restarted manager does not take the drone for one that never came up
        async with manager(server.url, tmp_path / "manager.creds") as restarted:
            control = restarted.control
            assert control is not None
            view = restarted.registry.view(SITE, DRONE)
            assert view is not None and view.record is not None
            assert view.record.tampered == f"removed ({operation})"
            verdict = control.may_remove(SITE, DRONE, lbs_running=True)
            assert (verdict.allowed, verdict.reason) == (False, Removal.RECORD_TAMPERED)
            result = await control.release(SITE, DRONE, note="demand dropped")
            assert result.outcome is ReleaseOutcome.TAMPERED and not result.may_remove
            assert await control.store.read(SITE, DRONE) is None  # nothing was written
            assert not control.may_remove(SITE, DRONE, lbs_running=True)
            assert not control.may_remove(SITE, DRONE, lbs_running=None)


async def test_a_forged_future_seq_hides_no_later_event(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = drone_creds(tmp_path, authority, SITE, DRONE)
    async with (
        as_drone(server.url, creds) as nc,
        manager(server.url, tmp_path / "manager.creds") as service,
    ):
        drone = await busy_and_up(nc)
        forged = msgspec.structs.replace(drone.heartbeat(), seq=2**64 - 1)
        await publish(nc, forged)
        # the agent restarts: a new incarnation whose seq is far below the forged one
        restarted = FakeDrone(SITE, DRONE, incarnation="inc2", seq=10)
        await publish(nc, restarted.started())
        await publish(nc, restarted.ready())
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, DRONE)) is not None
                and view.incarnation == "inc2"
                and view.state is ev.DroneState.IDLE
            ),
            what="the restarted agent's state",
        )
        view = service.registry.view(SITE, DRONE)
        assert view is not None and view.payloads == [] and view.seq == restarted.seq
    async with manager(server.url, tmp_path / "manager.creds") as again:
        assert again.registry.view(SITE, DRONE) == service.registry.view(SITE, DRONE)


def _hostile_stream(drone: FakeDrone, other: FakeDrone) -> list[tuple[str, bytes]]:
    """Valid events, then what a confused or hostile drone may add on its own subjects"""
    beat = drone.heartbeat()
    events = [drone.started(), drone.ready(), drone.payload_started("1.0")]
    subject = NS.event(SITE, drone.drone, "heartbeat")
    return [
        *((NS.event(SITE, drone.drone, ev.kind_of(type(e))), ev.encode(e)) for e in events),
        # a valid heartbeat with a lower seq, stored after newer events
        (subject, ev.encode(beat)),
        (NS.event(SITE, drone.drone, "payload_started"), ev.encode(drone.payload_started("2.0"))),
        # a body naming another drone, and an event of another kind than its subject
        (subject, ev.encode(other.heartbeat())),
        (NS.event(SITE, drone.drone, "drained"), ev.encode(drone.heartbeat())),
        # an invalid message last on the heartbeat subject
        (subject, b"\x82\xa1x" + b"\x91" * 2000 + b"\xc0\xa4kind\xa9heartbeat"),
    ]


async def test_live_rebuilt_and_timeline_agree_on_a_hostile_stream(
    nats_server: EmbeddedServer, nc: Client
) -> None:
    """Without credentials anyone may publish anything: still one truth"""
    from broker.server.provision import provision

    js = nc.jetstream()
    await provision(js)
    drone, other = FakeDrone(SITE, DRONE), FakeDrone(SITE, "site1-00000000bb")
    drone.seq = 5000  # the heartbeat below gets a lower seq than what follows it
    async with manager(nats_server.url) as service:
        stream = _hostile_stream(drone, other)
        low = ev.decode_event(stream[3][1])
        assert low.seq < ev.decode_event(stream[2][1]).seq
        for subject, data in stream:
            try:  # the writer's dedupe id, as an agent sends it
                headers = {"Nats-Msg-Id": ev.decode_event(data).id}
            except SchemaError:
                headers = None
            await js.publish(subject, data, headers=headers)
        await wait_until(
            lambda: service.consumer_stats.acked + service.consumer_stats.termed >= len(stream),
            what="every message handled",
        )
        live = service.registry.view(SITE, DRONE)
        assert live is not None and [p.job_id for p in live.payloads] == ["1.0", "2.0"]
        assert live.kind == "payload_started" and live.heartbeat_seq == low.seq
        assert service.registry.view(SITE, other.drone) is None
        rebuilt = Registry(NS)
        rebuilt.proof_key = service.registry.proof_key
        report, _ = await rebuild(nc, js, rebuilt)
        # the heartbeat and the drained subjects end with a message they must not hold
        assert report.resolved == 2
        assert dict(rebuilt.views()) == dict(service.registry.views())
        rows = await read_timeline(nc, NS, DRONE, heartbeats=True)
        assert [row.drone_event for row in rows] == [
            "agent_started on ?",
            "startd_ready: 4 slot(s)",
            "payload_started 1.0",
            "heartbeat",
            "payload_started 2.0",
        ]
        assert rows[-1].stream_seq == live.stream_seq and rows[-1].drone_state == str(live.state)


async def test_a_drone_cannot_read_the_managers_proof_key(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    async with manager(server.url, tmp_path / "manager.creds"):
        pass  # the manager made its key
    errors: list[str] = []

    async def note(err: Exception) -> None:
        errors.append(str(err))

    creds = drone_creds(tmp_path, authority, SITE, DRONE)
    nc = await connect(
        server.url, user_credentials=str(creds), inbox_prefix=f"_INBOX_{DRONE}", error_cb=note
    )
    try:
        bucket = NS.manager_bucket
        with pytest.raises(nats.errors.Error):
            await nc.request(
                f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{PROOF_KEY}", b"", timeout=2
            )
        await nc.subscribe(f"$KV.{bucket}.>")
        await nc.flush()
        await wait_until(lambda: len(errors) >= 2, what="two permission violations")
    finally:
        await nc.close()
    assert all("permissions violation" in error.lower() for error in errors), errors


@pytest.mark.parametrize("forgery", ["released", "deleted"])
async def test_tardis_never_removes_a_busy_drone_that_forged_its_record(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], forgery: str
) -> None:
    """TARDIS's own SiteAgent around our decorator: the site's condor_rm never runs"""
    server, authority = secured
    creds = drone_creds(tmp_path, authority, SITE, DRONE)
    config = BusConfig.from_mapping(
        {"servers": server.url, "creds": str(tmp_path / "manager.creds"), "lost_after_s": 60}
    )
    bus = RemoteBus(config, register=False)
    task = asyncio.create_task(bus.run())
    try:
        assert await bus.wait_ready(30)
        async with as_drone(server.url, creds) as nc:
            await busy_and_up(nc)
            if forgery == "released":
                forged = ev.DroneRecord(
                    site=SITE,
                    drone=DRONE,
                    phase=ev.RecordPhase.RELEASED,
                    writer="manager",
                    at=ev.utcnow(),
                )
                await write_record(nc, RECORD_SUBJECT, ev.encode(forged))
            else:
                await nc.jetstream().publish(RECORD_SUBJECT, b"", headers={"KV-Operation": "DEL"})
            await wait_until(
                lambda: (
                    (view := bus.registry.view(SITE, DRONE)) is not None
                    and len(view.payloads) == 2
                    and view.record is not None
                    and view.record.phase in (None, ev.RecordPhase.RELEASED)
                ),
                what="the forgery seen",
            )
            site = FakeSite(status=ResourceStatus.Running)
            site_agent = SiteAgent(RemoteSiteAdapter(site, bus))
            why = "without the manager's proof" if forgery == "released" else "tampered"
            for _ in range(3):  # TARDIS retries on every heartbeat
                with pytest.raises(TardisResourceStatusUpdateFailed, match=why):
                    await site_agent.stop_resource(attributes(DRONE))
                # a deferred terminate returns: TARDIS stays in CleanupState and asks again
                assert await site_agent.terminate_resource(attributes(DRONE)) is None
            assert site.called("terminate_resource") == site.called("stop_resource") == 0
    finally:
        bus.stop()
        await asyncio.wait_for(task, 30)
