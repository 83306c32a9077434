"""
A drone asking the server to relay its words, with its own credentials, on a real nats-server

The server's answers (JetStream acks, direct-get responses) go to whatever reply subject a
publish names; each test checks that nothing a drone has the server send in its place
changes another drone's view, its record, or the manager's proof key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
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

from broker.manager.rebuild import rebuild
from broker.manager.registry import Registry
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.proof import PROOF_KEY

pytestmark = pytest.mark.timeout(120)


# nats-server checks a publish against the publisher's permissions by its subject,
# not by its reply subject, and sends its own answers (JetStream acks, direct-get
# responses) to the reply subject: any stream capturing that subject stores them.


async def relay_own_key(nc: Client, body: bytes, target: str, *, no_headers: bool) -> None:
    """
    Write ``body`` to the own key (without compare-and-set: the target stream would
    check that header against the target's subject), then have the server send it to
    ``target``, with its answer headers or, asked for ``no_hdr``, with none
    """
    await nc.jetstream().publish(RECORD_SUBJECT, body)
    await nc.publish(OWN_DIRECT_GET, b'{"no_hdr":true}' if no_headers else b"", reply=target)
    await nc.flush()


async def test_a_drone_cannot_have_the_server_relay_its_words_onto_another_drone(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    attacker = drone_creds(tmp_path, authority, SITE, DRONE)
    victim_creds = drone_creds(tmp_path, authority, SITE, OTHER)
    victim = FakeDrone(SITE, OTHER)
    async with (
        as_drone(server.url, attacker) as nc,
        manager(server.url, tmp_path / "manager.creds") as service,
    ):
        victim_nc = await connect(
            server.url, user_credentials=str(victim_creds), inbox_prefix=f"_INBOX_{OTHER}"
        )
        try:
            for event in (
                victim.started(),
                victim.ready(),
                victim.payload_started("1.0"),
                victim.payload_started("2.0"),
            ):
                await publish(victim_nc, event)
            up = ev.DroneRecord(
                site=SITE,
                drone=OTHER,
                phase=ev.RecordPhase.UP,
                writer="agent",
                incarnation=victim.incarnation,
                at=ev.utcnow(),
            )
            await write_record(victim_nc, OTHER_RECORD, ev.encode(up))
        finally:
            await victim_nc.close()
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, OTHER)) is not None
                and len(view.payloads) == 2
                and view.phase is ev.RecordPhase.UP
            ),
            what="the busy victim",
        )
        before = service.registry.view(SITE, OTHER)
        assert before is not None
        # the victim's record and its heartbeat, in the attacker's words
        forged = msgspec.structs.replace(up, phase=ev.RecordPhase.DEADLINE_EXPIRED)
        idle = FakeDrone(SITE, OTHER, incarnation=victim.incarnation, seq=victim.seq)
        beat = ev.encode(idle.heartbeat())
        for no_headers in (False, True):
            await relay_own_key(nc, ev.encode(forged), OTHER_RECORD, no_headers=no_headers)
            await relay_own_key(nc, beat, NS.event(SITE, OTHER, "heartbeat"), no_headers=no_headers)
        # and the server's acks
        await nc.jetstream().publish(RECORD_SUBJECT, b"x")
        await nc.publish(NS.event(SITE, DRONE, "heartbeat"), b"x", reply=OTHER_RECORD)
        await nc.flush()
        await wait_until(
            lambda: service.registry.metrics().rejected["relayed"] >= 4,
            what="the relays rejected",
        )
        await wait_until(
            lambda: service.consumer_stats.acked + service.consumer_stats.termed >= 7,
            what="every event handled",
        )
        view = service.registry.view(SITE, OTHER)
        assert view is not None and view.record is not None
        # the victim's events are its own: the relayed heartbeat changed nothing
        assert (view.encoded, view.stream_seq) == (before.encoded, before.stream_seq)
        assert view.record.phase is None  # its record was overwritten: tampered, not believed
        control = service.control
        assert control is not None
        assert not control.may_remove(SITE, OTHER, lbs_running=True)
        assert not control.may_remove(SITE, OTHER, lbs_running=None)
        rebuilt = Registry(NS)
        rebuilt.proof_key = service.registry.proof_key
        await rebuild(control.nc, control.nc.jetstream(), rebuilt)
        assert dict(rebuilt.views()) == dict(service.registry.views())
    async with manager(server.url, tmp_path / "manager.creds") as restarted:
        assert restarted.control is not None
        assert not restarted.control.may_remove(SITE, OTHER, lbs_running=True)
        view = restarted.registry.view(SITE, OTHER)
        assert view is not None and len(view.payloads) == 2


async def test_the_proof_key_cannot_be_overwritten_through_a_relay(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    manager_creds = tmp_path / "manager.creds"
    async with manager(server.url, manager_creds) as service:
        assert service.registry.proof_key is not None
        key = service.registry.proof_key
    proof_subject = f"$KV.{NS.manager_bucket}.{PROOF_KEY}"
    async with as_drone(server.url, drone_creds(tmp_path, authority, SITE, DRONE)) as nc:
        await nc.publish(NS.event(SITE, DRONE, "heartbeat"), b"x", reply=proof_subject)
        await relay_own_key(nc, b"k" * 32, proof_subject, no_headers=False)
        await relay_own_key(nc, b"k" * 32, proof_subject, no_headers=True)
        await asyncio.sleep(0.5)
    async with manager(server.url, manager_creds) as restarted:  # ready: the key is intact
        assert restarted.registry.proof_key == key
