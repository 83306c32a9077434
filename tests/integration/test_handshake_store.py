"""The compare-and-set record operations, against a real nats-server"""

from __future__ import annotations

import asyncio
import datetime as dt
import random

import msgspec
import nats.js.errors
import pytest
from nats.js import JetStreamContext

from broker.server.provision import provision
from remote_agent.protocol import events as ev
from remote_agent.protocol.errors import HandshakeError, RecordTampered
from remote_agent.protocol.events import DrainIntent, RecordPhase, encode, utcnow
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import Namespace
from remote_agent.protocol.proof import load_proof_key, proven

NS = Namespace()
SITE = "site1"


def _intent(minutes: float = 10) -> DrainIntent:
    now = utcnow()
    return DrainIntent(
        deadline=now + dt.timedelta(minutes=minutes),
        reason="test",
        request_id="r1",
        requested_at=now,
    )


async def test_claim_first_wins(store: RecordStore) -> None:
    claimed = await store.claim(SITE, "d1", "inc1")
    assert (claimed.record.phase, claimed.record.writer) == (RecordPhase.UP, "agent")
    released = await store.release(SITE, "d1")
    assert released == claimed  # the agent won: the manager must drain instead


async def test_release_first_wins(store: RecordStore) -> None:
    released = await store.release(SITE, "d1", note="demand dropped")
    assert (released.record.phase, released.record.writer) == (RecordPhase.RELEASED, "manager")
    assert await store.claim(SITE, "d1", "inc1") == released
    assert await store.release(SITE, "d1") == released
    assert await store.request_drain(SITE, "d1", _intent()) == released


async def test_exactly_one_side_wins_every_race(store: RecordStore) -> None:
    rng = random.Random(172)

    async def agent(drone: str, delay: float) -> RecordPhase:
        await asyncio.sleep(delay)
        return (await store.claim(SITE, drone, "inc")).record.phase

    async def manager(drone: str, delay: float) -> RecordPhase:
        await asyncio.sleep(delay)
        return (await store.release(SITE, drone)).record.phase

    # close calls: both start within a few milliseconds of each other, in random order
    drones = [f"race-{i}" for i in range(300)]
    delays = {d: (rng.uniform(0, 0.005), rng.uniform(0, 0.005)) for d in drones}
    results = await asyncio.gather(
        *(agent(d, delays[d][0]) for d in drones), *(manager(d, delays[d][1]) for d in drones)
    )
    for claim, release in zip(results[: len(drones)], results[len(drones) :], strict=True):
        assert claim == release  # both sides agree on the single winner
        assert claim in (RecordPhase.UP, RecordPhase.RELEASED)
    # and each side can win: the same race with a clear head start either way
    assert await agent("head-start-agent", 0) == await manager("head-start-agent", 0)
    assert await manager("head-start-manager", 0) == RecordPhase.RELEASED
    assert await agent("head-start-manager", 0) == RecordPhase.RELEASED
    assert (await store.read(SITE, "head-start-agent")).record.phase is RecordPhase.UP  # type: ignore[union-attr]


async def test_drain_and_finish(store: RecordStore) -> None:
    await store.claim(SITE, "d1", "inc1")
    intent = _intent()
    draining = await store.request_drain(SITE, "d1", intent)
    assert draining.record.phase is RecordPhase.DRAINING
    assert draining.record.drain == intent
    # idempotent: a repeated drain changes nothing, even with another deadline
    assert await store.request_drain(SITE, "d1", _intent(5)) == draining
    # a restarted agent finds the drain and keeps its gate shut
    assert await store.claim(SITE, "d1", "inc2") == draining
    expired = await store.finish(SITE, "d1", "inc2", RecordPhase.DEADLINE_EXPIRED)
    assert (expired.record.phase, expired.record.drain) == (RecordPhase.DEADLINE_EXPIRED, intent)
    drained = await store.finish(SITE, "d1", "inc2", RecordPhase.DRAINED)
    assert drained.record.phase is RecordPhase.DRAINED
    assert await store.finish(SITE, "d1", "inc2", RecordPhase.DRAINED) == drained
    assert await store.finish(SITE, "d1", "inc2", RecordPhase.DEADLINE_EXPIRED) == drained
    assert await store.release(SITE, "d1") == drained


async def test_restarted_agent_reclaims(store: RecordStore) -> None:
    first = await store.claim(SITE, "d1", "inc1")
    assert await store.claim(SITE, "d1", "inc1") == first  # same incarnation: no write
    second = await store.claim(SITE, "d1", "inc2")
    assert second.revision > first.revision
    assert second.record.incarnation == "inc2"


async def test_drain_racing_a_reclaim_always_ends_draining(store: RecordStore) -> None:
    for i in range(50):
        drone = f"d{i}"
        await store.claim(SITE, drone, "old")
        claim, drain = await asyncio.gather(
            store.claim(SITE, drone, "new"), store.request_drain(SITE, drone, _intent())
        )
        final = await store.read(SITE, drone)
        assert final is not None and final.record.phase is RecordPhase.DRAINING
        assert drain == final
        assert claim.record.phase in (RecordPhase.UP, RecordPhase.DRAINING)


async def test_drain_of_unannounced_drone_is_refused(store: RecordStore) -> None:
    with pytest.raises(HandshakeError, match="has not announced itself"):
        await store.request_drain(SITE, "ghost", _intent())
    assert await store.read(SITE, "ghost") is None


async def test_invalid_stored_value_is_an_error(store: RecordStore) -> None:
    await store.kv.put(store.key(SITE, "bad"), b"\xc1garbage")
    with pytest.raises(HandshakeError, match="stored record of site1/bad is invalid"):
        await store.claim(SITE, "bad", "inc")
    await store.kv.put(store.key(SITE, "bad"), encode(_intent()))
    with pytest.raises(HandshakeError, match="invalid"):
        await store.read(SITE, "bad")


async def test_missing_bucket_is_a_clear_error(js: JetStreamContext) -> None:
    with pytest.raises(HandshakeError, match="run 'cobald-remote broker init'"):
        await RecordStore.open(js, NS)


@pytest.mark.parametrize("operation", ["DEL", "PURGE"])
async def test_a_removed_record_is_never_released_but_can_be_claimed(
    store: RecordStore, js: JetStreamContext, operation: str
) -> None:
    """
    A KV delete or purge marker on a key that held a record: its agent may be up,
    so the manager does not release it; an agent that starts claims over the marker
    """
    first = await store.claim(SITE, "d1", "inc1")
    key = store.key(SITE, "d1")
    # what `nats kv del` writes, and what a drone can write to its own key
    await js.publish(f"$KV.{NS.record_bucket}.{key}", b"", headers={"KV-Operation": operation})
    assert await store.read(SITE, "d1") is None
    assert await store.removed(SITE, "d1")
    with pytest.raises(RecordTampered, match="was removed"):
        await store.release(SITE, "d1", note="after the record was removed")
    again = await store.claim(SITE, "d1", "inc2")
    assert (again.record.phase, again.record.incarnation) == (RecordPhase.UP, "inc2")
    assert again.revision > first.revision
    assert not await store.removed(SITE, "d1")
    # and a release that loses to a live record still loses
    assert await store.release(SITE, "d1") == again


async def test_release_carries_the_managers_proof(js: JetStreamContext) -> None:
    await provision(js)
    key = await load_proof_key(js, NS)
    assert key == await load_proof_key(js, NS)  # made once, then read
    manager = await RecordStore.open(js, NS, proof_key=key)
    released = await manager.release(SITE, "d2")
    assert released.record.proof and manager.proven(released.record)
    assert proven(key, released.record)
    drone = await RecordStore.open(js, NS)
    assert not drone.proven(released.record)  # a drone has no key
    # a record without the proof, written like a drone could: no release
    claimed = await drone.claim(SITE, "d3", "inc1")
    forged = msgspec.structs.replace(claimed.record, phase=RecordPhase.RELEASED, writer="manager")
    await js.publish(f"$KV.{NS.record_bucket}.{drone.key(SITE, 'd3')}", ev.encode(forged))
    current = await manager.read(SITE, "d3")
    assert current is not None and current.record.phase is RecordPhase.RELEASED
    assert not manager.proven(current.record)


async def test_writes_name_the_domain_when_given(js: JetStreamContext) -> None:
    """With a JetStream domain, writes go to $JS.<domain>.API.$KV... (leaf nodes, see deploy)"""
    await provision(js)
    plain = await RecordStore.open(js, NS)
    assert plain.write_prefix == f"$KV.{NS.record_bucket}."
    hub = await RecordStore.open(js, NS, domain="hub")
    assert hub.write_prefix == f"$JS.hub.API.$KV.{NS.record_bucket}."


async def test_a_purge_that_would_erase_the_history_is_refused(store: RecordStore) -> None:
    """The bucket allows no rollups: nats-py's purge (a rollup) cannot erase a record"""
    claimed = await store.claim(SITE, "d4", "inc1")
    with pytest.raises(nats.js.errors.APIError, match="rollup not permitted"):
        await store.kv.purge(store.key(SITE, "d4"))
    assert await store.read(SITE, "d4") == claimed
