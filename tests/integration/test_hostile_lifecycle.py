"""
A drone against the end of drones' lives, with its own credentials, on a real nats-server

It may end only itself: it cannot publish TARDIS's state notes, nor have the server relay
one onto another drone's note subject, so no other drone is ended, purged or answered
``Deleted``; and when it makes itself look ended, the manager purges only its own record
and sends it nothing that could end its payloads.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from support.drones import FakeDrone
from support.hostile import (
    DRONE,
    NS,
    OTHER,
    OTHER_RECORD,
    OWN_DIRECT_GET,
    RECORD_SUBJECT,
    SITE,
    as_drone,
    manager,
    publish,
    write_record,
)
from support.servers import drone_creds
from support.waiting import wait_until

from broker.manager.lifecycle import TARDIS_DOWN, Ending, quiet_since
from broker.manager.rebuild import rebuild
from broker.manager.registry import Registry
from broker.manager.retire import retire_ended
from broker.server.embedded import EmbeddedServer
from broker.tardis.site import finished
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.names import MSG_ID

pytestmark = pytest.mark.timeout(120)


def _down_note(drone: str) -> ev.TardisState:
    return ev.TardisState(
        site=SITE, drone=drone, state=TARDIS_DOWN, at=ev.utcnow(), id=f"{drone}-down"
    )


async def _busy_victim(url: str, creds: Path) -> FakeDrone:
    """The victim announces itself, claims its record and runs two payloads"""
    victim = FakeDrone(SITE, OTHER)
    nc = await connect(url, user_credentials=str(creds), inbox_prefix=f"_INBOX_{OTHER}")
    try:
        for event in (
            victim.started(),
            victim.ready(),
            victim.payload_started("1.0"),
            victim.payload_started("2.0"),
        ):
            await publish(nc, event)
        up = ev.DroneRecord(
            site=SITE,
            drone=OTHER,
            phase=ev.RecordPhase.UP,
            writer="agent",
            incarnation=victim.incarnation,
            at=ev.utcnow(),
        )
        await write_record(nc, OTHER_RECORD, ev.encode(up))
    finally:
        await nc.close()
    return victim


async def test_a_drone_cannot_end_another_drone_through_tardis_notes(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    attacker = drone_creds(tmp_path, authority, SITE, DRONE)
    victim_creds = drone_creds(tmp_path, authority, SITE, OTHER)
    refused: list[Exception] = []

    async def note_error(err: Exception) -> None:
        refused.append(err)

    async with manager(server.url, tmp_path / "manager.creds") as service:
        await _busy_victim(server.url, victim_creds)
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, OTHER)) is not None
                and len(view.payloads) == 2
                and view.phase is ev.RecordPhase.UP
            ),
            what="the busy victim",
        )
        nc = await connect(
            server.url,
            user_credentials=str(attacker),
            inbox_prefix=f"_INBOX_{DRONE}",
            error_cb=note_error,
        )
        try:
            # straight onto the note subjects, its own and the victim's: refused by the server
            for drone in (DRONE, OTHER):
                note = _down_note(drone)
                await nc.publish(
                    NS.manager_note(SITE, drone, "tardis_state"),
                    ev.encode(note),
                    headers={MSG_ID: note.id},
                )
            await nc.flush()
            await wait_until(lambda: len(refused) >= 2, what="both publishes refused")
            assert all("permissions violation" in str(err).lower() for err in refused), refused
            # through a relay: its own record holds the victim's DownState note with the
            # writer's Nats-Msg-Id, and a direct get sends it to the victim's note subject
            note = _down_note(OTHER)
            target = NS.manager_note(SITE, OTHER, "tardis_state")
            for no_headers in (False, True):
                await nc.jetstream().publish(
                    RECORD_SUBJECT, ev.encode(note), headers={MSG_ID: note.id}
                )
                await nc.publish(
                    OWN_DIRECT_GET, b'{"no_hdr":true}' if no_headers else b"", reply=target
                )
            # and a JetStream acknowledgement onto it
            await nc.publish(NS.event(SITE, DRONE, "heartbeat"), b"x", reply=target)
            await nc.flush()
        finally:
            await nc.close()
        await wait_until(
            lambda: (
                service.registry.metrics().rejected["relayed"] >= 2
                and service.registry.metrics().rejected["malformed"] >= 2
            ),
            what="the relayed notes and acks rejected",
        )
        now = time.time()
        service.registry.mark_ended(now)
        view = service.registry.view(SITE, OTHER)
        assert view is not None and view.tardis_state == "" and not view.ended
        assert finished(view, now, service.settings.lost_after_s) == ""
        # nothing retires it before a drone silent for retain_lost_s would be
        since = quiet_since(view)
        assert since is not None
        retain_lost = service.settings.retain_lost_s
        assert service.registry.due_retirements(since + retain_lost - 1) == []
        # and a restarted manager reads the stream the same way
    async with manager(server.url, tmp_path / "manager.creds") as restarted:
        view = restarted.registry.view(SITE, OTHER)
        assert view is not None and not view.ended and len(view.payloads) == 2
        assert view.phase is ev.RecordPhase.UP


async def test_a_drone_that_fakes_its_own_end_loses_only_its_own_record(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """
    Its agent's words say drained and exiting while its payloads run: TARDIS may hear
    ``Deleted`` and the record goes at retirement, but only its own, and the manager sends
    it no command
    """
    server, authority = secured
    attacker = drone_creds(tmp_path, authority, SITE, DRONE)
    victim_creds = drone_creds(tmp_path, authority, SITE, OTHER)
    commands: list[Msg] = []
    async with manager(server.url, tmp_path / "manager.creds") as service:
        control = service.control
        assert control is not None

        async def command(msg: Msg) -> None:
            commands.append(msg)

        watch = await control.nc.subscribe(f"{NS.prefix}.{SITE}.*.cmd", cb=command)
        await _busy_victim(server.url, victim_creds)
        async with as_drone(server.url, attacker) as nc:
            liar = FakeDrone(SITE, DRONE)
            for event in (liar.started(), liar.ready(), liar.payload_started("9.0")):
                await publish(nc, event)
            drained = ev.DroneRecord(
                site=SITE,
                drone=DRONE,
                phase=ev.RecordPhase.DRAINED,
                writer="agent",
                incarnation=liar.incarnation,
                at=ev.utcnow(),
            )
            await write_record(nc, RECORD_SUBJECT, ev.encode(drained))
            exiting = liar.exiting()  # its snapshot still lists the payload
            assert exiting.snapshot.payloads
            await publish(nc, exiting)
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, DRONE)) is not None
                and view.ended == Ending.DRAINED
            ),
            what="the liar ended by its own words",
        )
        view = service.registry.view(SITE, DRONE)
        assert view is not None and view.ended_time is not None
        assert finished(view, time.time(), service.settings.lost_after_s) == Ending.DRAINED
        retain = service.settings.retain_ended_s
        js = control.nc.jetstream()
        done = await retire_ended(js, service.registry, view.ended_time + retain + 1)
        assert (done.retired, done.purged) == (1, 1)
        kv = await js.key_value(NS.record_bucket)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(NS.record_key(SITE, DRONE))
        # the victim is untouched: its record, its payloads, not ended
        entry = await kv.get(NS.record_key(SITE, OTHER))
        assert ev.decode_record(entry.value).phase is ev.RecordPhase.UP  # type: ignore[arg-type]
        victim = service.registry.view(SITE, OTHER)
        assert victim is not None and not victim.ended and len(victim.payloads) == 2
        await control.nc.flush()
        await asyncio.sleep(0.5)
        await watch.unsubscribe()
        assert commands == []


async def test_junk_for_made_up_drones_costs_the_rebuild_only_the_window(
    nc: Client, stream: JetStreamContext
) -> None:
    """Invalid messages of drones nobody knows are not followed up one by one"""
    for i in range(50):
        subject = NS.event(SITE, f"{SITE}-{i:010x}", "heartbeat")
        await stream.publish(subject, b"\xc1 not an event")
    registry = Registry(NS, lost_after_s=60.0)
    report, _ = await rebuild(nc, stream, registry)
    assert report.window_messages == 50
    assert (report.drones_read, report.resolved, len(registry)) == (0, 0, 0)
    assert sum(registry.rejected.values()) == 50
