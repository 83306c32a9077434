"""The registry fed by the real event stream: acks after apply, restarts, bad input, rebuild"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.protocol.parser import Parser
from support.drones import FakeDrone, publish
from support.manager import running_manager
from support.waiting import wait_until

from broker.errors import ConsumerError
from broker.jetstream.fastpath import FastParser
from broker.jetstream.messages import PullSettings
from broker.jetstream.pull import PullConsumer
from broker.manager.handler import event_handler
from broker.manager.rebuild import rebuild
from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.manager.validity import Rejection
from broker.manager.views import DroneView
from broker.server.durable import durable_config, ensure_consumer
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import Namespace

NS = Namespace()
SITE = "site1"
FAST = PullSettings(batch=50, expires_s=2.0, idle_heartbeat_s=0.5)


def _fleet(count: int, prefix: str = "site1-") -> list[FakeDrone]:
    return [FakeDrone(SITE, f"{prefix}{i:010x}") for i in range(count)]


async def _publish_story(js: JetStreamContext, drone: FakeDrone, steps: int) -> None:
    await publish(js, NS, drone.started())
    await publish(js, NS, drone.ready())
    for step in range(steps):
        if step % 3 == 1:
            await publish(js, NS, drone.payload_started(f"{drone.drone}.{step}"))
        elif step % 3 == 2 and drone.payloads:
            await publish(js, NS, drone.payload_finished(drone.payloads[0].job_id))
        else:
            await publish(js, NS, drone.heartbeat())


def _expected(drones: list[FakeDrone]) -> dict[tuple[str, str], tuple[int, ev.DroneState]]:
    return {(d.site, d.drone): (d.seq, d.state) for d in drones}


def _state(registry: Registry) -> dict[tuple[str, str], tuple[int | None, ev.DroneState | None]]:
    return {
        key: (view.seq, view.state)
        for key, view in registry.views().items()
        if view.seq is not None  # drones known only from their record have no events
    }


@contextlib.asynccontextmanager
async def _running(pull: PullConsumer) -> AsyncIterator[PullConsumer]:
    stop = asyncio.Event()
    task = asyncio.create_task(pull.run(stop))
    try:
        yield pull
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


@contextlib.asynccontextmanager
async def _service(
    server: EmbeddedServer, registry: Registry | None = None, **options: object
) -> AsyncIterator[ManagerService]:
    settings = ManagerSettings(
        servers=[server.url], retry_s=0.2, pull=FAST, lost_check_s=0.5, **options
    )  # type: ignore[arg-type]
    async with running_manager(settings, registry) as service:
        yield service


async def test_consumer_applies_then_acks(nc: Client, stream: JetStreamContext) -> None:
    await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "t"))
    drones = _fleet(5)
    for drone in drones:
        await _publish_story(stream, drone, 8)
    registry = Registry(NS)
    pull = PullConsumer(
        nc, NS.event_stream, "t", event_handler(registry), settings=FAST, headers=True
    )
    assert pull.direct
    async with _running(pull):
        await wait_until(lambda: _state(registry) == _expected(drones), what="all applied")
        info = await stream.consumer_info(NS.event_stream, "t")
        last = (await stream.stream_info(NS.event_stream)).state.last_seq
        for _ in range(200):
            if info.ack_floor is not None and info.ack_floor.stream_seq == last:
                break
            await asyncio.sleep(0.05)
            info = await stream.consumer_info(NS.event_stream, "t")
    assert pull.is_direct
    assert isinstance(nc._ps, FastParser)  # the connection's parser took the short way
    assert info.num_ack_pending == 0
    assert info.ack_floor is not None and info.ack_floor.stream_seq == last
    assert pull.stats.acked == pull.stats.delivered == last
    assert registry.metrics().applied == last


async def test_portable_path_works_too(nc: Client, stream: JetStreamContext) -> None:
    """The nats-py Msg path, used when direct dispatch is unavailable, gives the same state"""
    await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "portable"))
    drones = _fleet(3)
    for drone in drones:
        await _publish_story(stream, drone, 5)
    registry = Registry(NS)
    pull = PullConsumer(
        nc,
        NS.event_stream,
        "portable",
        event_handler(registry),
        settings=FAST,
        direct=False,
        headers=True,
    )
    async with _running(pull):
        await wait_until(lambda: _state(registry) == _expected(drones), what="all applied")
    assert not pull.is_direct
    assert type(nc._ps) is Parser  # nats-py's parser, untouched
    assert pull.stats.acked == registry.metrics().applied


async def test_crash_before_ack_means_redelivery(nc: Client, stream: JetStreamContext) -> None:
    config = durable_config(NS.all_events, "crashy", ack_wait_s=1.0)
    await ensure_consumer(stream, NS.event_stream, config)
    drones = _fleet(3)
    for drone in drones:
        await _publish_story(stream, drone, 4)
    total = (await stream.stream_info(NS.event_stream)).state.last_seq

    first = Registry(NS)
    # applies every message and never answers: a manager that dies before its acks
    # are written (a handler that raises rejects its message instead)
    crashing = PullConsumer(
        nc, NS.event_stream, "crashy", event_handler(first), settings=FAST, acks=False, headers=True
    )
    async with _running(crashing):
        await wait_until(lambda: crashing.stats.delivered >= total, what="all handled once")
    assert crashing.stats.acked == crashing.stats.termed == 0

    second = Registry(NS)
    pull = PullConsumer(
        nc, NS.event_stream, "crashy", event_handler(second), settings=FAST, headers=True
    )
    async with _running(pull):
        await wait_until(lambda: _state(second) == _expected(drones), what="redelivered")
        await wait_until(lambda: pull.stats.acked >= total, what="acked")
        # an ack that comes after the 1 s ack wait (a loaded machine) finds the message
        # delivered again; the running consumer acks that delivery too
        for _ in range(300):
            info = await stream.consumer_info(NS.event_stream, "crashy")
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.1)
    assert dict(second.views()) == dict(first.views())
    assert info.num_ack_pending == 0


async def test_consumer_creation_is_idempotent(stream: JetStreamContext) -> None:
    config = durable_config(NS.all_events, "same")
    first = await ensure_consumer(stream, NS.event_stream, config)
    again = await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "same"))
    assert first.name == again.name == "same"
    other = durable_config(f"{NS.prefix}.site9.*.evt.>", "same")
    with pytest.raises(ConsumerError, match=r"exists with another configuration.*filter_subject"):
        await ensure_consumer(stream, NS.event_stream, other)


async def test_garbage_and_forgeries_are_termed_and_counted(
    nc: Client, stream: JetStreamContext
) -> None:
    config = durable_config(NS.all_events, "strict", ack_wait_s=1.0)
    await ensure_consumer(stream, NS.event_stream, config)
    honest, victim = FakeDrone(SITE, "site1-000000000a"), FakeDrone(SITE, "site1-000000000b")
    await publish(stream, NS, honest.heartbeat())
    victim_subject = NS.event(SITE, victim.drone, "heartbeat")
    await stream.publish(victim_subject, b"\x93garbage")
    forged = honest.heartbeat()  # honest's body on the victim's subject
    await stream.publish(victim_subject, ev.encode(forged))
    await stream.publish(NS.event(SITE, honest.drone, "drained"), ev.encode(honest.heartbeat()))

    registry = Registry(NS)
    pull = PullConsumer(
        nc, NS.event_stream, "strict", event_handler(registry), settings=FAST, headers=True
    )
    async with _running(pull):
        await wait_until(lambda: pull.stats.delivered >= 4, what="all delivered")
        await wait_until(lambda: pull.stats.termed == 3, what="termed")
        # terminated messages are not redelivered after ack_wait (1 s)
        await asyncio.sleep(2.5)
        assert pull.stats.delivered == 4
    metrics = registry.metrics()
    assert metrics.rejected[Rejection.MALFORMED] == 1
    assert metrics.rejected[Rejection.SENDER] == 2
    assert registry.view(SITE, victim.drone) is None
    view = registry.view(SITE, honest.drone)
    assert view is not None and view.seq == honest.seq - 2  # only its first heartbeat
    info = await stream.consumer_info(NS.event_stream, "strict")
    assert info.num_ack_pending == 0


# --------------------------------------------------------------------------- the service


async def test_service_restart_loses_no_acknowledged_event(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    drones = _fleet(6)
    async with _service(nats_server) as service:
        for drone in drones[:3]:
            await _publish_story(stream, drone, 6)
        await wait_until(
            lambda: _state(service.registry) == _expected(drones[:3]), what="first half"
        )
    # the manager is down while more events come
    for drone in drones:
        await _publish_story(stream, drone, 3)
    before = dict(service.registry.views())
    async with _service(nats_server) as restarted:  # a new, empty registry
        assert restarted.registry is not service.registry
        assert restarted.last_rebuild is not None
        await wait_until(lambda: _state(restarted.registry) == _expected(drones), what="everything")
        for key, view in before.items():
            now = restarted.registry.view(*key)
            assert now is not None and now.seq is not None and view.seq is not None
            assert now.seq >= view.seq


async def test_broker_restart_loses_no_acknowledged_event(
    nats_server: EmbeddedServer, nc: Client, stream: JetStreamContext
) -> None:
    drones = _fleet(4)
    async with _service(nats_server) as service:
        for drone in drones:
            await _publish_story(stream, drone, 4)
        await wait_until(lambda: _state(service.registry) == _expected(drones), what="before")
        await nats_server.restart()
        await wait_until(lambda: nc.is_connected, what="test client reconnected")
        for drone in drones:
            await _publish_story(stream, drone, 4)
        await wait_until(
            lambda: _state(service.registry) == _expected(drones), 40, what="after restart"
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
    drones = _fleet(40)
    async with _service(nats_server) as service:
        for number, drone in enumerate(drones):
            await _publish_story(stream, drone, 2 + number % 7)
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
        await wait_until(lambda: _state(service.registry) == _expected(everyone), what="live")
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
    drones = _fleet(5)
    for drone in drones:
        await _publish_story(stream, drone, 4)
    registry = Registry(NS)
    async with _service(nats_server, registry) as service:
        await wait_until(lambda: _state(registry) == _expected(drones), what="live")
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
    drones = _fleet(2)
    async with _service(nats_server) as service:
        await _publish_story(stream, drones[0], 3)
        await wait_until(lambda: _state(service.registry) == _expected(drones[:1]))
        await stream.delete_consumer(NS.event_stream, service.settings.durable)
        await _publish_story(stream, drones[1], 3)  # may fall between delete and recreate
        await wait_until(lambda: _state(service.registry) == _expected(drones), 40)
        assert service.failures >= 1
        info = await stream.consumer_info(NS.event_stream, service.settings.durable)
        assert info.config.deliver_policy is not None


async def test_ephemeral_reader_reads_what_was_there(nc: Client, stream: JetStreamContext) -> None:
    from broker.jetstream.reads import read_all

    drones = _fleet(3)
    for drone in drones:
        await _publish_story(stream, drone, 2)
    seen: list[str] = []
    count = await read_all(
        nc,
        stream,
        NS.event_stream,
        ConsumerConfig(filter_subject=NS.all_events),
        lambda subject, reply, data, headers: seen.append(subject),
        settings=FAST,
    )
    assert count == len(seen) == (await stream.stream_info(NS.event_stream)).state.messages
    # the ephemeral consumer is gone afterwards
    assert await stream.consumers_info(NS.event_stream) == []


async def test_ephemeral_reader_ends_when_what_it_counted_was_purged_meanwhile(
    nc: Client, stream: JetStreamContext
) -> None:
    """
    A retirement purges records while a rebuild reads them: the purged ones never come,
    and the read ends once the server has nothing left, not at its timeout
    """
    from broker.jetstream.reads import read_all

    drones = _fleet(3)
    for drone in drones:
        await _publish_story(stream, drone, 2)
    last = NS.drone_events(drones[-1].site, drones[-1].drone)
    purged: list[str] = []
    seen: list[str] = []
    tasks: set[asyncio.Task[object]] = set()

    def handle(subject: str, reply: str, data: bytes, headers: object) -> None:
        seen.append(subject)
        if not purged:  # the first message: the last drone's events go before they are read
            purged.append(subject)
            task = asyncio.ensure_future(stream.purge_stream(NS.event_stream, subject=last))
            tasks.add(task)

    count = await read_all(
        nc,
        stream,
        NS.event_stream,
        ConsumerConfig(filter_subject=NS.all_events),
        handle,
        settings=PullSettings(batch=1, expires_s=1.0, idle_heartbeat_s=0.5),
        timeout_s=60,
    )
    await asyncio.gather(*tasks)
    assert count == len(seen) < 3 * 2 * 2  # fewer than counted at the start: some were purged
    assert not [subject for subject in seen[1:] if subject.startswith(last.rstrip(">"))]
    assert await stream.consumers_info(NS.event_stream) == []
