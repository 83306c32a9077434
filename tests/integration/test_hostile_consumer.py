"""
Poison on the event stream: messages nobody can apply never stall the manager

A message whose handler raises (about 1,000 levels of nesting in an unknown
field make msgspec raise ``RecursionError``; a bug raises anything else) is
terminated and counted, the valid events around it are applied, nothing stays
unacknowledged, and the rebuild (``read_all``, ``cobald-remote status``)
reads past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from support.drones import FakeDrone, publish
from support.manager import running_manager
from support.processes import CLI, run_process
from support.waiting import wait_until

from broker.jetstream.messages import ConsumerStats, Disposition, PullSettings
from broker.jetstream.pull import PullConsumer
from broker.jetstream.reads import read_all
from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.durable import durable_config, ensure_consumer
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace

CONSUMER_LOG = "cobald.runtime.cobald_remote.consumer"

NS = Namespace()
SITE = "site1"
FAST = PullSettings(batch=50, expires_s=2.0, idle_heartbeat_s=0.5)


def deeply_nested(event: ev.Event, depth: int = 1_000) -> bytes:
    """``event`` with an unknown field of ``depth`` nested arrays (about 1.2 KB at 1,000)"""
    data = ev.encode(event)
    assert 0x80 <= data[0] < 0x8F  # a fixmap: one more entry fits
    return bytes([data[0] + 1]) + data[1:] + b"\xa4junk" + b"\x91" * depth + b"\xc0"


def test_the_poison_makes_msgspec_recurse() -> None:
    data = deeply_nested(FakeDrone(SITE, "site1-0000000001").heartbeat())
    assert 1_000 < len(data) < 1_500
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(data)


async def _publish_story(js: JetStreamContext, drone: FakeDrone, steps: int) -> None:
    await publish(js, NS, drone.started())
    await publish(js, NS, drone.ready())
    for step in range(steps):
        if step % 2:
            await publish(js, NS, drone.payload_started(f"{drone.drone}.{step}"))
        else:
            await publish(js, NS, drone.heartbeat())


async def _poison(js: JetStreamContext, drone: FakeDrone, kind: str = "heartbeat") -> None:
    """A valid-looking event of ``drone`` (its next ``seq``) made undecodable"""
    await js.publish(NS.event(SITE, drone.drone, kind), deeply_nested(drone.heartbeat()))


def _state(registry: Registry) -> dict[tuple[str, str], tuple[int | None, ev.DroneState | None]]:
    return {key: (view.seq, view.state) for key, view in registry.views().items()}


async def _settled(js: JetStreamContext, name: str) -> None:
    """Every delivered message of consumer ``name`` answered, and none redelivered"""
    last = (await js.stream_info(NS.event_stream)).state.last_seq
    for _ in range(200):
        info = await js.consumer_info(NS.event_stream, name)
        if info.num_ack_pending == 0 and info.delivered.stream_seq == last:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.05)
    assert info.num_ack_pending == 0, f"{info.num_ack_pending} messages left unacknowledged"
    assert info.num_redelivered == 0


@contextlib.asynccontextmanager
async def _service(server: EmbeddedServer, **options: object) -> AsyncIterator[ManagerService]:
    settings = ManagerSettings(
        servers=[server.url], retry_s=0.2, pull=FAST, lost_check_s=0.5, ack_wait_s=1.0, **options
    )  # type: ignore[arg-type]
    async with running_manager(settings) as service:
        yield service


# --------------------------------------------------------------------------- the live consumer


async def test_deeply_nested_events_are_termed_and_valid_ones_applied(
    nats_server: EmbeddedServer, stream: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    """Poison from two drones among valid events of five: all valid ones apply, nothing hangs"""
    drones = [FakeDrone(SITE, f"site1-{i:010x}") for i in range(5)]
    caplog.set_level(logging.WARNING)
    async with _service(nats_server) as service:
        poison = 0
        for round_ in range(3):
            for number, drone in enumerate(drones):
                await _publish_story(stream, drone, 2)
                if number in (1, 3):
                    await _poison(stream, drone, ("heartbeat", "payload_started", "ready")[round_])
                    poison += 1
        # the poison took a seq each: the drone's newest valid event is one before
        expected = {
            (d.site, d.drone): d.seq - (d.drone in {drones[1].drone, drones[3].drone})
            for d in drones
        }
        await wait_until(
            lambda: {k: s for k, (s, _) in _state(service.registry).items()} == expected,
            what="every valid event applied",
        )
        stats = service.consumer_stats
        await wait_until(lambda: stats.termed >= poison, what="the poison termed")
        await asyncio.sleep(1.5)  # longer than ack_wait: nothing comes back
        await _settled(stream, service.settings.durable)
        assert stats.acked + stats.termed == stats.delivered
        assert stats.termed == poison and stats.nacked == 0
    for record in caplog.records:  # the payload is never logged
        assert "\\x91\\x91" not in record.getMessage() and "junk" not in record.getMessage()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "portable"])
async def test_a_handler_that_raises_terms_and_counts(
    nc: Client, stream: JetStreamContext, direct: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """ValueError, RuntimeError, RecursionError: each message termed, counted; the loop goes on"""
    name = f"raising-{direct}"
    await ensure_consumer(
        stream, NS.event_stream, durable_config(NS.all_events, name, ack_wait_s=1.0)
    )
    drones = [FakeDrone(SITE, f"site1-{i:010x}") for i in range(3)]
    for drone in drones:
        await _publish_story(stream, drone, 3)
        await stream.publish(NS.event(SITE, drone.drone, "heartbeat"), b"value error")
        await stream.publish(NS.event(SITE, drone.drone, "ready"), b"runtime error")
        await _poison(stream, drone)
    for drone in drones:
        await publish(stream, NS, drone.heartbeat())  # after the poison: still applied
    total = (await stream.stream_info(NS.event_stream)).state.last_seq
    applied: dict[str, int] = {}

    def handler(
        subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> Disposition:
        if data == b"value error":
            raise ValueError("no")
        if data == b"runtime error":
            raise RuntimeError("a bug")
        event = msgspec.msgpack.decode(data)  # RecursionError on the poison
        applied[event["drone"]] = event["seq"]
        return Disposition.ACK

    caplog.set_level(logging.WARNING, logger=CONSUMER_LOG)
    pull = PullConsumer(nc, NS.event_stream, name, handler, settings=FAST, direct=direct)
    stop = asyncio.Event()
    task = asyncio.create_task(pull.run(stop))
    try:
        await wait_until(lambda: pull.stats.delivered >= total, what="everything delivered")
        await asyncio.sleep(1.5)  # longer than ack_wait: nothing is redelivered
        await _settled(stream, name)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    stats = pull.stats
    assert stats.delivered == total
    assert applied == {d.drone: d.seq for d in drones}
    assert stats.handler_errors == stats.termed == 9
    assert stats.handler_error_types == {"ValueError": 3, "RuntimeError": 3, "RecursionError": 3}
    assert stats.acked == total - 9
    # rate-limited: one line per kind, naming the subject and the type, never the payload
    lines = [r.getMessage() for r in caplog.records if r.name == CONSUMER_LOG]
    assert len(lines) == 3
    assert any(
        "RecursionError" in line and NS.event(SITE, drones[0].drone, "heartbeat") in line
        for line in lines
    )
    assert all("terminated" in line and "a bug" not in line for line in lines)


async def test_a_bug_in_the_registry_does_not_stop_the_manager(
    nats_server: EmbeddedServer, stream: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry raising for one drone's events: others go on, the errors are counted"""
    buggy = FakeDrone(SITE, "site1-00000000ee")
    honest = [FakeDrone(SITE, f"site1-{i:010x}") for i in range(3)]
    original = Registry.apply_message

    def apply_message(
        self: Registry, data: bytes, subject: str, *args: Any, **kwargs: Any
    ) -> object:
        if buggy.drone in subject:
            raise RuntimeError("a bug in the registry")
        return original(self, data, subject, *args, **kwargs)

    monkeypatch.setattr(Registry, "apply_message", apply_message)
    await _publish_story(stream, buggy, 2)  # in the stream before the start: the rebuild reads it
    async with _service(nats_server) as service:
        for _ in range(3):
            for drone in [*honest, buggy]:
                await _publish_story(stream, drone, 2)
        expected = {(d.site, d.drone): d.seq for d in honest}
        await wait_until(
            lambda: {k: s for k, (s, _) in _state(service.registry).items()} == expected,
            what="the other drones' events applied",
        )
        stats = service.consumer_stats
        await wait_until(lambda: stats.handler_errors == 3 * 4, what="every buggy event counted")
        await asyncio.sleep(1.5)  # longer than ack_wait
        await _settled(stream, service.settings.durable)
        assert stats.handler_error_types == {"RuntimeError": 12}
        assert stats.termed >= 12 and stats.acked + stats.termed == stats.delivered
        assert service.failures == 0


# --------------------------------------------------------------------------- max_deliver


async def test_an_existing_durable_gets_a_bounded_max_deliver(stream: JetStreamContext) -> None:
    """A durable without max_deliver (as older managers made it) is updated in place"""
    unbounded = dataclasses.replace(durable_config(NS.all_events, "old"), max_deliver=None)
    created = await stream.add_consumer(NS.event_stream, unbounded)
    assert created.config.max_deliver == -1  # the server's "unlimited"
    info = await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "old"))
    bound = info.config.max_deliver
    assert bound is not None and 1 < bound <= 10
    assert bound == durable_config(NS.all_events, "old").max_deliver
    again = await stream.consumer_info(NS.event_stream, "old")
    assert again.config.max_deliver == bound


async def test_a_message_never_answered_stops_after_max_deliver(
    nc: Client, stream: JetStreamContext
) -> None:
    """A message that fails every time (nak) goes out max_deliver times, then the server says so"""
    name = "giving-up"
    await ensure_consumer(
        stream, NS.event_stream, durable_config(NS.all_events, name, ack_wait_s=1.0)
    )
    drone, hopeless = FakeDrone(SITE, "site1-0000000001"), FakeDrone(SITE, "site1-0000000002")
    await publish(stream, NS, drone.heartbeat())
    await publish(stream, NS, hopeless.heartbeat())
    await publish(stream, NS, drone.heartbeat())
    seen: dict[str, int] = {}

    def handler(
        subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> Disposition:
        seen[subject] = seen.get(subject, 0) + 1
        return Disposition.NAK if hopeless.drone in subject else Disposition.ACK

    pull = PullConsumer(nc, NS.event_stream, name, handler, settings=FAST)
    stop = asyncio.Event()
    task = asyncio.create_task(pull.run(stop))
    try:
        await wait_until(lambda: pull.stats.nacked >= 2, what="redelivered")
        await asyncio.sleep(2.0)  # a nak is redelivered at once: enough for any bound
        deliveries = seen[NS.event(SITE, hopeless.drone, "heartbeat")]
        await asyncio.sleep(1.5)  # longer than ack_wait: it stopped
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    info = await stream.consumer_info(NS.event_stream, name)
    max_deliver = info.config.max_deliver
    assert max_deliver is not None and max_deliver > 1
    assert seen[NS.event(SITE, hopeless.drone, "heartbeat")] == deliveries == max_deliver
    assert seen[NS.event(SITE, drone.drone, "heartbeat")] == 2
    assert pull.stats.nacked == max_deliver
    assert info.num_ack_pending == 0
    assert pull.stats.max_deliveries == 1  # the server's advisory, counted


# --------------------------------------------------------------------------- the rebuild


async def test_read_all_reads_past_poison(nc: Client, stream: JetStreamContext) -> None:
    """Handlers raising on some messages: read_all still reads every message, and ends there"""
    drones = [FakeDrone(SITE, f"site1-{i:010x}") for i in range(4)]
    for drone in drones:
        await _publish_story(stream, drone, 3)
        await _poison(stream, drone)
        await stream.publish(NS.event(SITE, drone.drone, "ready"), b"runtime error")
    total = (await stream.stream_info(NS.event_stream)).state.messages

    def handler(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        if data == b"runtime error":
            raise RuntimeError("a bug")
        msgspec.msgpack.decode(data)

    config = ConsumerConfig(filter_subject=NS.all_events)
    # it ends on the last message: a read that waited for more would raise TimeoutError
    count = await read_all(nc, stream, NS.event_stream, config, handler, timeout_s=15.0)
    assert count == total
    stats = ConsumerStats()
    count = await read_all(nc, stream, NS.event_stream, config, handler, stats=stats)
    assert count == total == stats.delivered
    assert stats.handler_error_types == {"RecursionError": 4, "RuntimeError": 4}
    assert stats.termed == stats.acked == 0  # AckNone: skipped, nothing to answer
    assert await stream.consumers_info(NS.event_stream) == []


@pytest.mark.timeout(45)
async def test_status_answers_on_a_quiet_bus_holding_one_poison_message(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    drone = FakeDrone(SITE, "site1-00000000b1")
    await _publish_story(stream, drone, 3)
    await _poison(stream, drone)  # its newest heartbeat
    # answers at all: run_process fails the test if it has not ended within 20 s
    code, out, err = await run_process(*CLI, "status", "--server", nats_server.url, timeout_s=20)
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert drone.drone in rows
    assert "\\x91" not in err and "junk" not in err


async def _publish_raw(server: EmbeddedServer, subject: bytes, payload: bytes) -> None:
    """Publish on a subject that is not UTF-8, which no client library lets one write"""
    host, _, port = server.url.removeprefix("nats://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        writer.write(b"PUB %s %d\r\n%s\r\nPING\r\n" % (subject, len(payload), payload))
        await writer.drain()
        assert await asyncio.wait_for(reader.readline(), 10) == b"PONG\r\n"
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_subject_that_is_not_utf8_is_termed(
    nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    """A drone may publish any bytes below its own subjects: the manager rejects, not chokes"""
    drones = [FakeDrone(SITE, f"site1-{i:010x}") for i in range(2)]
    async with _service(nats_server) as service:
        await _publish_story(stream, drones[0], 2)
        root = NS.event(SITE, drones[0].drone, "heartbeat").removesuffix("heartbeat").encode()
        await _publish_raw(nats_server, root + b"\xff\xfe", ev.encode(drones[0].heartbeat()))
        for drone in drones:
            await _publish_story(stream, drone, 2)
        expected = {(d.site, d.drone): d.seq for d in drones}
        await wait_until(
            lambda: {k: s for k, (s, _) in _state(service.registry).items()} == expected,
            what="the events after it applied",
        )
        await wait_until(lambda: service.consumer_stats.termed == 1, what="termed")
        await _settled(stream, service.settings.durable)
        assert service.failures == 0
    # and the rebuild reads past it
    code, out, err = await run_process(*CLI, "status", "--server", nats_server.url, timeout_s=20)
    assert code == 0, err
    assert {line.split()[0] for line in out.splitlines()[1:]} == {d.drone for d in drones}
