"""Ended drones on a real server: retired without a trace in the bucket; rebuilds bounded"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.drones import FakeDrone, answer_commands, publish
from support.servers import drone_creds

from broker.manager.control import Control
from broker.manager.lifecycle import TARDIS_DOWN, Ending, quiet_since
from broker.manager.outcomes import DrainOutcome, ReleaseOutcome
from broker.manager.rebuild import rebuild
from broker.manager.records import RecordFeed, load_records
from broker.manager.registry import Registry
from broker.manager.retire import retire_ended
from broker.manager.timeline import read_timeline
from broker.manager.verdict import Removal
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import MSG_ID, Namespace

NS = Namespace()
SITE = "site1"
LOST = 60.0


def _fresh(registry: Registry | None = None) -> Registry:
    fresh = Registry(NS, lost_after_s=LOST, retain_ended_s=10.0)
    if registry is not None:
        fresh.proof_key = registry.proof_key
    return fresh


async def _life(js: JetStreamContext, store: RecordStore, drone: FakeDrone) -> None:
    """A whole life: claim, run, drain, exit"""
    await publish(js, NS, drone.started())
    await store.claim(SITE, drone.drone, drone.incarnation)
    await publish(js, NS, drone.heartbeat())
    await store.finish(SITE, drone.drone, drone.incarnation, ev.RecordPhase.DRAINED)
    await publish(js, NS, drone.drained())
    await publish(js, NS, drone.exiting())


async def _note(js: JetStreamContext, drone: str, state: str) -> None:
    note = ev.TardisState(
        site=SITE, drone=drone, state=state, at=dt.datetime.now(dt.UTC), id=f"{drone}-{state}"
    )
    await js.publish(
        NS.manager_note(SITE, drone, "tardis_state"), ev.encode(note), headers={MSG_ID: note.id}
    )


async def test_retirement_purges_the_record_without_a_marker(
    nc: Client, stream: JetStreamContext, store: RecordStore
) -> None:
    drone = FakeDrone(SITE, "site1-00000000a1")
    await _life(stream, store, drone)
    registry = _fresh()
    _, feed = await rebuild(nc, stream, registry)
    view = registry.view(SITE, drone.drone)
    assert view is not None and view.ended == Ending.DRAINED and view.ended_time is not None
    assert (await retire_ended(stream, registry, view.ended_time + 5)).retired == 0
    done = await retire_ended(stream, registry, view.ended_time + 10)
    assert (done.retired, done.purged, done.kept) == (1, 1, 0)
    assert registry.view(SITE, drone.drone) is None
    assert await store.read(SITE, drone.drone) is None
    # nothing left for a watcher: no delete or purge marker on the key
    info = await stream.stream_info(NS.record_stream)
    assert info.state.messages == 0
    later = RecordFeed(registry, NS.record_bucket)
    assert (await load_records(nc, stream, _fresh())).next_seq == feed.next_seq
    assert later.next_seq == 1
    # the events stay, for the timeline
    assert (await stream.stream_info(NS.event_stream)).state.messages == 4


async def test_the_timeline_still_shows_a_retired_drone(
    nc: Client, stream: JetStreamContext, store: RecordStore
) -> None:
    """What docs/operations.md promises after retirement: the events, until the stream's age"""
    drone = FakeDrone(SITE, "site1-00000000a3")
    await _life(stream, store, drone)
    registry = _fresh()
    await rebuild(nc, stream, registry)
    view = registry.view(SITE, drone.drone)
    assert view is not None and view.ended_time is not None
    rows = await read_timeline(nc, NS, drone.drone, heartbeats=True)
    assert len(rows) == 5  # the four events, and the end as the manager sees it
    end = rows[-1]
    assert (end.source, end.drone_event, end.drone_state) == (
        "manager",
        "ended: drained",
        "exiting",
    )
    assert (end.at, end.stream_seq) == (view.ended_time, None)
    assert (await retire_ended(stream, registry, view.ended_time + 10)).retired == 1
    rows = await read_timeline(nc, NS, drone.drone, SITE, heartbeats=True)
    assert len(rows) == 4  # the record that told its end is purged
    assert {row.source for row in rows} == {"agent"}
    await _note(stream, drone.drone, "DownState")  # without the record, only TARDIS's note tells
    rows = await read_timeline(nc, NS, drone.drone, SITE)
    assert (rows[-1].source, rows[-1].drone_event) == ("manager", "ended: removed")


async def test_a_drone_cannot_purge_the_bucket(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority_file = secured
    drone = "site1-00000000a2"
    creds = drone_creds(tmp_path, authority_file, SITE, drone)
    agent = await nats.connect(
        server.url, user_credentials=str(creds), inbox_prefix=f"_INBOX_{drone}"
    )
    try:
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await agent.jetstream(timeout=1).purge_stream(
                NS.record_stream, subject=NS.record_subject(SITE, drone)
            )
    finally:
        await agent.close()


async def test_rebuild_reads_the_live_fleet_not_the_retired(
    nc: Client, stream: JetStreamContext, store: RecordStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retired drones' events stay in the stream and are not read; ended state survives"""
    import broker.manager.rebuild as rebuild_module

    retired = [FakeDrone(SITE, f"site1-0000000{n:03x}") for n in range(40)]
    for drone in retired:
        await _life(stream, store, drone)
    registry = _fresh()
    registry.lost_after_s = LOST
    await rebuild(nc, stream, registry)
    assert registry.metrics().ended == 40
    done = await retire_ended(stream, registry, 1e12)
    assert done.purged == 40 and len(registry) == 0
    live = [FakeDrone(SITE, f"site1-0000001{n:03x}") for n in range(5)]
    for drone in live:
        await publish(stream, NS, drone.started())
        await store.claim(SITE, drone.drone, drone.incarnation)
        await publish(stream, NS, drone.heartbeat())
    ended = FakeDrone(SITE, "site1-00000002aa")
    await _life(stream, store, ended)
    removed = FakeDrone(SITE, "site1-00000002bb")
    await publish(stream, NS, removed.started())
    await store.claim(SITE, removed.drone, removed.incarnation)
    await _note(stream, removed.drone, "BootingState")
    await _note(stream, removed.drone, TARDIS_DOWN)
    await stream.publish(NS.event(SITE, live[0].drone, "heartbeat"), b"junk")  # hostile

    # retirement comes a retention after the end, long after the window: shrink the window
    monkeypatch.setattr(rebuild_module, "WINDOW_LOST_AFTER", 1e-9)
    first = _fresh(registry)
    report, _ = await rebuild(nc, stream, first)
    assert report.window_messages == 0
    assert report.drones_read == 7  # the drones with a record, none of the retired
    # the newest of each of their subjects, and the hostile heartbeat's subject in full
    assert report.resolved == 1
    views = first.views()
    assert len(views) == 7
    ended_view, removed_view = views[SITE, ended.drone], views[SITE, removed.drone]
    assert (ended_view.ended, removed_view.ended) == (Ending.DRAINED, Ending.REMOVED)
    again = _fresh(registry)
    await rebuild(nc, stream, again)
    assert dict(again.views()) == dict(views)


async def test_rebuild_window_bounds_what_is_read(
    nc: Client, stream: JetStreamContext, store: RecordStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tiny window, only live drones' newest messages are read, one drone at a time"""
    import broker.manager.rebuild as rebuild_module

    for n in range(30):  # retired: events in the stream, no record
        drone = FakeDrone(SITE, f"site1-0000003{n:03x}")
        for _ in range(5):
            await publish(stream, NS, drone.heartbeat())
    live = FakeDrone(SITE, "site1-00000004aa")
    await publish(stream, NS, live.started())
    await store.claim(SITE, live.drone, live.incarnation)
    await publish(stream, NS, live.heartbeat())
    monkeypatch.setattr(rebuild_module, "WINDOW_LOST_AFTER", 1e-9)
    registry = _fresh()
    report, _ = await rebuild(nc, stream, registry)
    assert report.window_messages == 0
    assert (report.drones_read, report.drone_messages) == (1, 2)
    assert list(registry.views()) == [(SITE, live.drone)]


async def test_a_bucket_that_denies_purges_keeps_records(
    nc: Client, js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    """An old bucket the server will not open to purges: provisioned, warned, drones retired"""
    import dataclasses

    from broker.server.provision import Topology, provision

    topology = Topology()
    await js.add_stream(dataclasses.replace(topology.record_bucket(), deny_purge=True))
    assert (await provision(js))[NS.record_stream] == "unchanged"
    assert "denies purges" in caplog.text
    store = await RecordStore.open(js, NS)
    drone = FakeDrone(SITE, "site1-00000005aa")
    await _life(js, store, drone)
    registry = _fresh()
    await rebuild(nc, js, registry)
    done = await retire_ended(js, registry, 1e12)
    assert (done.retired, done.purged, done.kept) == (1, 0, 1)
    assert await store.read(SITE, drone.drone) is not None


async def test_a_lost_drone_is_retired_and_back_without_its_record_is_drained_not_released(
    nc: Client, stream: JetStreamContext, store: RecordStore
) -> None:
    """After ``retain_lost_s`` of silence the record goes; the drone that comes back with
    payloads is drained by the command, and no record the manager writes lets TARDIS kill them"""
    drone = FakeDrone(SITE, "site1-00000006aa")
    await publish(stream, NS, drone.started())
    await store.claim(SITE, drone.drone, drone.incarnation)
    await publish(stream, NS, drone.ready())
    await publish(stream, NS, drone.payload_started("7.0"))
    registry = Registry(NS, lost_after_s=LOST, retain_ended_s=10.0, retain_lost_s=2 * LOST)
    control = await Control.open(nc, registry, request_timeout_s=0.5)
    await rebuild(nc, stream, registry)
    view = registry.view(SITE, drone.drone)
    assert view is not None and not view.ended
    since = quiet_since(view)
    assert since is not None
    assert (await retire_ended(stream, registry, since + 2 * LOST - 1)).retired == 0
    done = await retire_ended(stream, registry, since + 2 * LOST)
    assert (done.retired, done.purged, done.lost) == (1, 1, 1)
    assert await store.read(SITE, drone.drone) is None
    assert registry.view(SITE, drone.drone) is None

    await publish(stream, NS, drone.heartbeat())  # back, its payload running
    await rebuild(nc, stream, registry)
    back = registry.view(SITE, drone.drone)
    assert back is not None and back.record is None and back.payloads
    seen: list[ev.AnyCommand] = []
    sub = await answer_commands(
        nc, NS, drone, lambda _: (ev.Outcome.DRAIN_ACCEPTED, "gate closed"), seen
    )
    try:
        released = await control.release(SITE, drone.drone, note="TARDIS stop")
        drained = await control.drain(SITE, drone.drone, reason="TARDIS stop")
    finally:
        await sub.unsubscribe()
    assert released.outcome is ReleaseOutcome.TAMPERED and not released.may_remove
    assert drained.outcome is DrainOutcome.TAMPERED
    assert [type(c) for c in seen] == [ev.DrainCommand, ev.DrainCommand]
    assert await store.read(SITE, drone.drone) is None  # no release written
    for lbs in (True, None, False):
        verdict = control.may_remove(SITE, drone.drone, lbs)
        assert (verdict.allowed, verdict.reason) == (False, Removal.RECORD_TAMPERED)


async def test_a_forced_release_of_a_drone_that_never_spoke_is_retired(
    nc: Client, stream: JetStreamContext
) -> None:
    registry = Registry(NS, lost_after_s=LOST, retain_ended_s=10.0, retain_lost_s=2 * LOST)
    control = await Control.open(nc, registry, request_timeout_s=0.5)
    drone = "site1-00000006bb"
    assert (await control.release(SITE, drone, note="forced")).outcome is ReleaseOutcome.RELEASED
    fresh = Registry(NS, lost_after_s=LOST, retain_ended_s=10.0, retain_lost_s=2 * LOST)
    fresh.proof_key = registry.proof_key
    await rebuild(nc, stream, fresh)
    view = fresh.view(SITE, drone)
    assert view is not None and view.record is not None and view.record.stored is not None
    assert not view.ended  # its job may still be queued: no end, only the bound
    assert (await retire_ended(stream, fresh, view.record.stored + 2 * LOST - 1)).retired == 0
    done = await retire_ended(stream, fresh, view.record.stored + 2 * LOST)
    assert (done.retired, done.purged, done.lost) == (1, 1, 1)
    assert (await stream.stream_info(NS.record_stream)).state.messages == 0
