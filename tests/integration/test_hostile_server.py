"""
What the server enforces against a hostile drone, with per-drone credentials

A real nats-server in operator mode (``broker/server/auth/``), the streams as
``broker/server/provision.py`` makes them, and drones that use their own
credentials for everything they may do and try what they may not: roll up
or purge the record bucket or the event stream, publish on subjects of
their own making, hold more subscriptions than allowed, send oversized
messages, and flood one subject until its history is capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig
from support.agent import SITE
from support.drones import FakeDrone
from support.waiting import wait_until

from broker.server.auth.authority import Authority, create_authority
from broker.server.auth.credentials import drone_credentials, manager_credentials
from broker.server.auth.jwt import creds_claims, decode_jwt
from broker.server.embedded import EmbeddedServer
from broker.server.provision import Topology, provision
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import Namespace

pytestmark = pytest.mark.timeout(120)
NS = Namespace()
FLOODER = "site1-00000000aa"
HONEST = "site1-00000000bb"


@dataclasses.dataclass
class Bus:
    server: EmbeddedServer
    authority: Authority
    directory: Path
    manager: Client

    async def drone(self, name: str, **options: object) -> tuple[Client, list[str]]:
        """A connection on ``name``'s own credentials, and the errors it is sent"""
        creds = self.directory / f"{name}.creds"
        creds.write_text(drone_credentials(self.authority, NS, SITE, name))
        errors: list[str] = []

        async def note(err: Exception) -> None:
            errors.append(str(err).lower())

        client = await connect(
            self.server.url,
            user_credentials=str(creds),
            inbox_prefix=f"_INBOX_{name}",
            error_cb=note,
            **options,
        )
        return client, errors


async def _secured(tmp_path: Path, topology: Topology | None = None) -> AsyncIterator[Bus]:
    authority = create_authority()
    config = tmp_path / "server.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n' + authority.server_config()
    )
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:
        creds = tmp_path / "manager.creds"
        creds.write_text(manager_credentials(authority))
        manager = await connect(server.url, user_credentials=str(creds))
        try:
            await provision(manager.jetstream(), topology)
            yield Bus(server, authority, tmp_path, manager)
        finally:
            await manager.close()


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[Bus]:
    async for value in _secured(tmp_path):
        yield value


@pytest.fixture
async def capped(tmp_path: Path) -> AsyncIterator[Bus]:
    """Like ``bus``, with a per-subject cap of 10 (a small flood fills it)"""
    async for value in _secured(tmp_path, Topology(event_max_msgs_per_subject=10)):
        yield value


def _record_subject(drone: str) -> str:
    return f"$KV.{NS.record_bucket}.{NS.record_key(SITE, drone)}"


def _heartbeat(drone: str, seq: int) -> bytes:
    return ev.encode(FakeDrone(SITE, drone, seq=seq).heartbeat())


async def _refused_purge(drone: Client, errors: list[str], stream: str) -> None:
    """A drone has no JetStream API but direct gets: its purge request is refused"""
    await drone.publish(f"$JS.API.STREAM.PURGE.{stream}", b"{}")
    await drone.flush()
    await wait_until(lambda: any("stream.purge" in error for error in errors), 10, "refusal")
    assert all("permissions violation" in error for error in errors), errors


@pytest.mark.parametrize("rollup", ["all", "sub"])
async def test_a_drone_cannot_roll_up_the_record_bucket(bus: Bus, rollup: str) -> None:
    """``Nats-Rollup`` on a drone's own key is refused; every other record stays"""
    js = bus.manager.jetstream()
    honest, _ = await bus.drone(HONEST)
    flooder, errors = await bus.drone(FLOODER)
    try:
        await honest.jetstream().publish(_record_subject(HONEST), b"honest record")
        await flooder.jetstream().publish(_record_subject(FLOODER), b"first")
        with pytest.raises(nats.js.errors.APIError, match="rollup not permitted"):
            await flooder.jetstream().publish(
                _record_subject(FLOODER), b"", headers={"Nats-Rollup": rollup}
            )
        bucket = f"KV_{NS.record_bucket}"
        assert (await js.stream_info(bucket)).state.messages == 2
        kept = await js.get_last_msg(bucket, _record_subject(HONEST))
        assert kept.data == b"honest record"
        await _refused_purge(flooder, errors, bucket)
        assert (await js.stream_info(bucket)).state.messages == 2
    finally:
        await flooder.close()
        await honest.close()


@pytest.mark.parametrize("rollup", ["all", "sub"])
async def test_a_drone_cannot_roll_up_the_event_stream(bus: Bus, rollup: str) -> None:
    js = bus.manager.jetstream()
    honest, _ = await bus.drone(HONEST)
    flooder, errors = await bus.drone(FLOODER)
    try:
        for seq in (1, 2):
            await honest.jetstream().publish(
                NS.event(SITE, HONEST, "heartbeat"), _heartbeat(HONEST, seq)
            )
        with pytest.raises(nats.js.errors.APIError, match="rollup not permitted"):
            await flooder.jetstream().publish(
                NS.event(SITE, FLOODER, "heartbeat"),
                _heartbeat(FLOODER, 1),
                headers={"Nats-Rollup": rollup},
            )
        assert (await js.stream_info(NS.event_stream)).state.messages == 2
        await _refused_purge(flooder, errors, NS.event_stream)
        assert (await js.stream_info(NS.event_stream)).state.messages == 2
    finally:
        await flooder.close()
        await honest.close()


async def test_a_drone_publishes_only_the_event_kinds_there_are(bus: Bus) -> None:
    """Its own subjects of made-up kinds are refused by the server, not stored"""
    drone, errors = await bus.drone(FLOODER)
    try:
        ack = await drone.jetstream().publish(
            NS.event(SITE, FLOODER, "heartbeat"), _heartbeat(FLOODER, 1)
        )
        assert ack.stream == NS.event_stream
        root = NS.drone_root(SITE, FLOODER)
        for subject in (f"{root}.evt.no_such_kind", f"{root}.evt.heartbeat.x", f"{root}.mgr.x"):
            await drone.publish(subject, b"x")
        await drone.flush()
        await wait_until(lambda: len(errors) >= 3, 10, "three permission violations")
        assert all("permissions violation" in error for error in errors), errors
        info = await bus.manager.jetstream().stream_info(NS.event_stream)
        assert info.state.messages == 1
    finally:
        await drone.close()


async def test_a_drone_over_its_subscription_limit_is_refused(bus: Bus) -> None:
    """Past 16 subscriptions the server refuses the next (nats-py then closes the client)"""
    drone, _ = await bus.drone(FLOODER, allow_reconnect=False)
    try:
        limit = creds_claims((bus.directory / f"{FLOODER}.creds").read_text())["nats"]["subs"]
        assert limit == 16
        with contextlib.suppress(nats.errors.Error):
            for n in range(limit + 4):
                await drone.subscribe(f"_INBOX_{FLOODER}.{n}")
            await drone.flush()
        await wait_until(lambda: drone.is_closed, 10, "the refusal")
        assert "maximum subscriptions exceeded" in str(drone.last_error).lower()
    finally:
        await drone.close()
    # the agent needs three: its command subject, its record hint, its request inbox
    again, errors = await bus.drone(FLOODER)
    try:
        for subject in (NS.command(SITE, FLOODER), _record_subject(FLOODER)):
            await again.subscribe(subject)
        ack = await again.jetstream().publish(
            NS.event(SITE, FLOODER, "heartbeat"), _heartbeat(FLOODER, 1)
        )
        assert ack.stream == NS.event_stream and not errors
    finally:
        await again.close()


async def test_a_drone_that_sends_an_oversized_message_is_cut_off(bus: Bus) -> None:
    """Over the drone's payload limit (far below the server's) the server closes it"""
    closed = asyncio.Event()

    async def on_close() -> None:
        closed.set()

    drone, _ = await bus.drone(FLOODER, allow_reconnect=False, closed_cb=on_close)
    try:
        assert drone.max_payload > 128 * 1024  # the server's own limit would let it pass
        await drone.publish(NS.event(SITE, FLOODER, "heartbeat"), b"x" * (128 * 1024))
        await asyncio.wait_for(closed.wait(), 10)
        info = await bus.manager.jetstream().stream_info(NS.event_stream)
        assert info.state.messages == 0
    finally:
        await drone.close()


async def test_a_flooding_drone_evicts_only_its_own_history(capped: Bus) -> None:
    """Per-subject discard: the flood keeps its newest 10 per kind; the others keep all"""
    js = capped.manager.jetstream()
    honest, _ = await capped.drone(HONEST)
    flooder, _ = await capped.drone(FLOODER)
    try:
        for seq in range(5):
            await honest.jetstream().publish(
                NS.event(SITE, HONEST, "heartbeat"), _heartbeat(HONEST, seq)
            )
        flood = flooder.jetstream()
        acks = [
            flood.publish_async(NS.event(SITE, FLOODER, kind), _heartbeat(FLOODER, seq))
            for seq in range(300)
            for kind in ("heartbeat", "payload_started")
        ]
        # publish_async returns once sent; its future resolves with the server's ack
        futures = await asyncio.gather(*acks)
        await asyncio.wait_for(asyncio.gather(*futures), 60)
        info = await js.stream_info(NS.event_stream, subjects_filter=f"{NS.prefix}.>")
        assert info.state.subjects == {
            NS.event(SITE, HONEST, "heartbeat"): 5,
            NS.event(SITE, FLOODER, "heartbeat"): 10,
            NS.event(SITE, FLOODER, "payload_started"): 10,
        }
        first = await js.get_msg(NS.event_stream, info.state.first_seq)
        assert first.subject == NS.event(SITE, HONEST, "heartbeat")  # the oldest stayed
    finally:
        await flooder.close()
        await honest.close()


async def test_provisioning_puts_the_caps_on_existing_streams(nc: Client) -> None:
    """Streams made without the caps (rollups allowed, no limits) are updated in place"""
    js = nc.jetstream()
    topology = Topology()
    old_events = dataclasses.replace(
        topology.event_stream(), max_bytes=-1, max_msgs_per_subject=-1, allow_rollup_hdrs=True
    )
    old_bucket = dataclasses.replace(
        topology.record_bucket(), allow_rollup_hdrs=True, deny_purge=False
    )
    for config in (old_events, old_bucket):
        await js.add_stream(config)
    await js.publish(NS.event(SITE, HONEST, "heartbeat"), _heartbeat(HONEST, 1))
    assert await provision(js, topology) == {
        NS.event_stream: "updated",
        f"KV_{NS.record_bucket}": "updated",
        f"KV_{NS.manager_bucket}": "created",
        f"KV_{NS.grant_bucket}": "created",
    }
    events = (await js.stream_info(NS.event_stream)).config
    assert (events.max_bytes, events.max_msgs_per_subject, events.allow_rollup_hdrs) == (
        topology.event_max_bytes,
        topology.event_max_msgs_per_subject,
        False,
    )
    bucket: StreamConfig = (await js.stream_info(f"KV_{NS.record_bucket}")).config
    # purges stay allowed: the manager purges the records of retired drones
    assert (bucket.allow_rollup_hdrs, bucket.deny_purge, bucket.deny_delete) == (
        False,
        False,
        True,
    )
    assert (await js.stream_info(NS.event_stream)).state.messages == 1  # nothing lost
    assert await provision(js, topology) == {
        NS.event_stream: "unchanged",
        f"KV_{NS.record_bucket}": "unchanged",
        f"KV_{NS.manager_bucket}": "unchanged",
        f"KV_{NS.grant_bucket}": "unchanged",
    }


def test_the_account_and_the_drones_carry_limits() -> None:
    """The JWTs carry what docs/deployment.md#limits lists (the servers enforce them)"""
    authority = create_authority()
    account_jwt = authority.server_config().split(f"  {authority.account_public}: ")[1]
    limits = decode_jwt(account_jwt.split("\n")[0])["nats"]["limits"]
    assert limits["disk_storage"] == 16 * 1024**3
    assert (limits["mem_storage"], limits["streams"], limits["consumer"]) == (0, 8, 100)
    assert (limits["conn"], limits["leaf"]) == (50_000, 256)
    assert limits["subs"] == limits["payload"] == -1  # per connection: the manager's too
    drone = creds_claims(drone_credentials(authority, NS, SITE, HONEST))["nats"]
    assert (drone["subs"], drone["payload"]) == (16, DEFAULT_MAX_SIZE + 4096)
    assert drone["allowed_connection_types"] == ["STANDARD"]
    events = {s for s in drone["pub"]["allow"] if ".evt." in s}
    assert events == {NS.event(SITE, HONEST, ev.kind_of(kind)) for kind in ev.EVENT_TYPES}
