"""The manager service fed by the real event stream: restarts, rebuild, lost drones"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.drones import FakeDrone, publish
from support.manager import running_manager
from support.stories import FAST, NS, SITE, expected, fleet, publish_story, state_of
from support.waiting import wait_until

from broker.manager import lifecycle
from broker.manager.rebuild import rebuild
from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.manager.views import DroneView
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol.events import RecordPhase
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.ratelog import RateLimitedLog


@contextlib.asynccontextmanager
async def _service(
    server: EmbeddedServer, registry: Registry | None = None, **options: object
) -> AsyncIterator[ManagerService]:
    settings = ManagerSettings(
        servers=[server.url], retry_s=0.2, pull=FAST, lost_check_s=0.5, **options
    )  # type: ignore[arg-type]
    async with running_manager(settings, registry) as service:
        yield service


async def test_service_restart_loses_no_acknowledged_event(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    drones = fleet(6)
    async with _service(nats_server) as service:
        for drone in drones[:3]:
            await publish_story(stream, drone, 6)
        await wait_until(
            lambda: state_of(service.registry) == expected(drones[:3]), what="first half"
        )
    # the manager is down while more events come
    for drone in drones:
        await publish_story(stream, drone, 3)
    before = dict(service.registry.views())
    async with _service(nats_server) as restarted:  # a new, empty registry
        assert restarted.registry is not service.registry
        assert restarted.last_rebuild is not None
        await wait_until(
            lambda: state_of(restarted.registry) == expected(drones), what="everything"
        )
        for key, view in before.items():
            now = restarted.registry.view(*key)
            assert now is not None and now.seq is not None and view.seq is not None
            assert now.seq >= view.seq


async def test_broker_restart_loses_no_acknowledged_event(
    nats_server: EmbeddedServer, nc: Client, stream: JetStreamContext
) -> None:
    drones = fleet(4)
    async with _service(nats_server) as service:
        for drone in drones:
            await publish_story(stream, drone, 4)
        await wait_until(lambda: state_of(service.registry) == expected(drones), what="before")
        await nats_server.restart()
        await wait_until(lambda: nc.is_connected, what="test client reconnected")
        for drone in drones:
            await publish_story(stream, drone, 4)
        await wait_until(
            lambda: state_of(service.registry) == expected(drones), 40, what="after restart"
        )
        for _ in range(400):
            info = await stream.consumer_info(NS.event_stream, service.settings.durable)
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info.num_ack_pending == 0


async def test_rebuild_equals_live_state(
    nats_server: EmbeddedServer, nc: Client, stream: JetStreamContext
) -> None:
    store = await RecordStore.open(stream, NS)
    drones = fleet(40)
    async with _service(nats_server) as service:
        for number, drone in enumerate(drones):
            await publish_story(stream, drone, 2 + number % 7)
            if number % 4 == 0:
                await store.claim(SITE, drone.drone, drone.incarnation)
            if number % 8 == 0:
                await publish(stream, NS, drone.drained())
                await publish(stream, NS, drone.exiting())
                await publish(stream, NS, drone.heartbeat())  # the very last word
            elif number % 5 == 0:
                # events after the drone's newest heartbeat must come from the replay
                await publish(stream, NS, drone.payload_started(f"late.{number}"))
        for number in range(5):  # drones that never came up, released by the manager
            await store.release(SITE, f"site1-ffff{number:06x}")
        # a drone whose only event is not a heartbeat, published after all heartbeats
        late = FakeDrone(SITE, "site1-eeeeeeeeee")
        await publish(stream, NS, late.started())
        everyone = [*drones, late]
        await wait_until(lambda: state_of(service.registry) == expected(everyone), what="live")
        await wait_until(
            lambda: sum(v.record is not None for v in service.registry.views().values()) == 15,
            what="records",
        )
        rebuilt = Registry(NS)
        rebuilt.proof_key = service.registry.proof_key
        report, _ = await rebuild(nc, stream, rebuilt)
        live = dict(service.registry.views())
        info = await stream.stream_info(NS.event_stream, subjects_filter=NS.all_events)
    # every message is in the window, and nothing hidden behind an invalid one
    assert report.window_messages == info.state.messages and report.resolved == 0
    assert dict(rebuilt.views()) == live


async def test_rebuild_survives_restart_of_manager_between(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    """Kill-free check: a second rebuild into a filled registry changes nothing"""
    drones = fleet(5)
    for drone in drones:
        await publish_story(stream, drone, 4)
    registry = Registry(NS)
    async with _service(nats_server, registry) as service:
        await wait_until(lambda: state_of(registry) == expected(drones), what="live")
        before = dict(registry.views())
        report, _ = await rebuild(service.control.nc, stream, registry)  # type: ignore[union-attr]
        assert dict(registry.views()) == before
        assert report.last_seq == (await stream.stream_info(NS.event_stream)).state.last_seq


async def test_lost_marking_in_the_service(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    drone = FakeDrone(SITE, "site1-0000000001")
    async with _service(nats_server, lost_after_s=2.0) as service:
        await publish(stream, NS, drone.heartbeat(interval_s=0.2))
        await wait_until(lambda: service.registry.view(SITE, drone.drone) is not None)
        await wait_until(
            lambda: _lost(service.registry.view(SITE, drone.drone)), what="marked lost"
        )
        await publish(stream, NS, drone.heartbeat(interval_s=0.2))
        await wait_until(lambda: not _lost(service.registry.view(SITE, drone.drone)))


def _lost(view: DroneView | None) -> bool:
    return view is not None and view.lost


async def test_service_waits_for_a_missing_server_and_never_raises(tmp_path: object) -> None:
    settings = ManagerSettings(servers=["nats://127.0.0.1:1"], retry_s=0.1)
    service = ManagerService(settings)
    task = asyncio.create_task(service.run())
    await wait_until(lambda: service.failures >= 1, 60, what="a failed attempt")
    assert not task.done() and not service.ready.is_set()
    service.stop()
    await asyncio.wait_for(task, 30)
    assert task.result() is None


async def test_deleted_durable_is_recreated_and_rebuilt(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    drones = fleet(2)
    async with _service(nats_server) as service:
        await publish_story(stream, drones[0], 3)
        await wait_until(lambda: state_of(service.registry) == expected(drones[:1]))
        await stream.delete_consumer(NS.event_stream, service.settings.durable)
        await publish_story(stream, drones[1], 3)  # may fall between delete and recreate
        await wait_until(lambda: state_of(service.registry) == expected(drones), 40)
        assert service.failures >= 1
        info = await stream.consumer_info(NS.event_stream, service.settings.durable)
        assert info.config.deliver_policy is not None


async def test_a_restarted_manager_does_not_tell_the_lives_it_replays_again(
    nats_server: EmbeddedServer,
    stream: JetStreamContext,
    store: RecordStore,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "lines", RateLimitedLog(lifecycle.log, interval_s=0.0))
    done = FakeDrone(SITE, "site1-00000000d1")

    def told(drone: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if getattr(r, "drone", None) == drone]

    with caplog.at_level(logging.INFO, lifecycle.log.name):
        async with _service(nats_server) as service:
            for event in (done.started(), done.ready(), done.payload_started("1.0")):
                await publish(stream, NS, event)
            await store.claim(SITE, done.drone, done.incarnation)
            await store.finish(SITE, done.drone, done.incarnation, RecordPhase.DRAINED)
            await publish(stream, NS, done.exiting())
            await wait_until(
                lambda: (
                    (view := service.registry.view(SITE, done.drone)) is not None
                    and bool(view.ended)
                ),
                what="the drone's end",
            )
        lives = told(done.drone)
        assert [line.split(" ", 2)[2] for line in lives] == [
            "announced itself (agent_started, starting)",
            "started its first payload",
            "ended: drained",
        ]
        caplog.clear()
        later = FakeDrone(SITE, "site1-00000000d2")
        async with _service(nats_server) as restarted:
            view = restarted.registry.view(SITE, done.drone)
            assert view is not None and view.ended == "drained"  # replayed, and kept
            await publish(stream, NS, later.started())  # what happens now is told
            await wait_until(lambda: bool(told(later.drone)), what="the new drone's line")
        assert told(done.drone) == []
