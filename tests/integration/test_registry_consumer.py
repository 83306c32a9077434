"""The registry fed by the real event stream: acks after apply, redelivery, bad input, reads"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.protocol.parser import Parser
from support.drones import FakeDrone, publish
from support.stories import FAST, NS, SITE, expected, fleet, publish_story, state_of
from support.waiting import wait_until, wait_until_async

from broker.errors import ConsumerError
from broker.jetstream.fastpath import FastParser, self_check
from broker.jetstream.messages import PullSettings
from broker.jetstream.pull import PullConsumer
from broker.manager.handler import event_handler
from broker.manager.registry import Registry
from broker.manager.validity import Rejection
from broker.server.durable import durable_config, ensure_consumer
from remote_agent.protocol import events as ev


@contextlib.asynccontextmanager
async def _running(pull: PullConsumer) -> AsyncIterator[PullConsumer]:
    stop = asyncio.Event()
    task = asyncio.create_task(pull.run(stop))
    try:
        yield pull
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def test_consumer_applies_then_acks(nc: Client, stream: JetStreamContext) -> None:
    await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "t"))
    drones = fleet(5)
    for drone in drones:
        await publish_story(stream, drone, 8)
    registry = Registry(NS)
    pull = PullConsumer(
        nc, NS.event_stream, "t", event_handler(registry), settings=FAST, headers=True
    )
    assert pull.direct
    async with _running(pull):
        await wait_until(lambda: state_of(registry) == expected(drones), what="all applied")
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


async def test_acks_of_events_that_trickle_in_are_written_together(
    nc: Client, stream: JetStreamContext
) -> None:
    """Events arriving one socket read each are acknowledged in fewer writes than events"""
    await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "trickle"))
    registry = Registry(NS)
    pull = PullConsumer(
        nc, NS.event_stream, "trickle", event_handler(registry), settings=FAST, headers=True
    )
    drone = FakeDrone(SITE, f"{SITE}-00000000a1")
    async with _running(pull):
        await publish(stream, NS, drone.started())
        await wait_until(lambda: registry.view(SITE, drone.drone) is not None, what="applied")
        direct = pull._direct
        assert direct is not None
        before = direct.writes
        for _ in range(50):  # each awaits its PubAck: one at a time at the consumer
            await publish(stream, NS, drone.heartbeat())
        last = (await stream.stream_info(NS.event_stream)).state.last_seq

        async def acked() -> bool:
            info = await stream.consumer_info(NS.event_stream, "trickle")
            return info.ack_floor is not None and info.ack_floor.stream_seq == last

        for _ in range(1000):  # polled: the server's word that every ack arrived
            if await acked():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("not every event was acknowledged")
    assert registry.view(SITE, drone.drone).heartbeat_seq == drone.seq  # type: ignore[union-attr]
    assert 1 <= direct.writes - before < 25  # one write per event without the window


async def test_portable_path_works_too(nc: Client, stream: JetStreamContext) -> None:
    """The nats-py Msg path, used when direct dispatch is unavailable, gives the same state"""
    await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "portable"))
    drones = fleet(3)
    for drone in drones:
        await publish_story(stream, drone, 5)
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
        await wait_until(lambda: state_of(registry) == expected(drones), what="all applied")
    assert not pull.is_direct
    assert type(nc._ps) is Parser  # nats-py's parser, untouched
    assert pull.stats.acked == registry.metrics().applied


async def test_this_nats_py_passes_the_self_check(nc: Client) -> None:
    assert self_check(nc) is None


async def _unexpected_process_msg(nc: Client) -> None:
    """A nats-py whose ``Client._process_msg`` takes one more parameter"""
    original = nc._process_msg

    async def process_msg(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None, extra: int = 0
    ) -> None:
        await original(sid, subject, reply, data, headers)  # type: ignore[arg-type]

    nc._process_msg = process_msg  # type: ignore[method-assign]


async def _unexpected_parser(nc: Client) -> None:
    """A nats-py whose connection parses with a class of its own"""

    class OtherParser(Parser):
        pass

    nc._ps.__class__ = OtherParser


@pytest.mark.parametrize(
    ("differ", "reason"),
    [
        (_unexpected_process_msg, "Client._process_msg takes"),
        (_unexpected_parser, "the client's parser is a"),
    ],
    ids=["process_msg", "parser"],
)
async def test_a_nats_py_that_differs_falls_back_loudly(
    nc: Client,
    stream: JetStreamContext,
    caplog: pytest.LogCaptureFixture,
    differ: Callable[[Client], Awaitable[None]],
    reason: str,
) -> None:
    """Internals not as expected: a WARNING, a counted fallback, every event still applied"""
    await differ(nc)
    parser_type = type(nc._ps)
    await ensure_consumer(stream, NS.event_stream, durable_config(NS.all_events, "other"))
    drones = fleet(3)
    for drone in drones:
        await publish_story(stream, drone, 5)
    registry = Registry(NS)
    pull = PullConsumer(
        nc, NS.event_stream, "other", event_handler(registry), settings=FAST, headers=True
    )
    with caplog.at_level(logging.WARNING, logger="cobald.runtime.cobald_remote.consumer"):
        async with _running(pull):
            await wait_until(lambda: state_of(registry) == expected(drones), what="all applied")
    assert not pull.is_direct
    assert pull.stats.direct_fallbacks == 1
    assert type(nc._ps) is parser_type  # left as it was
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "cobald.runtime.cobald_remote.consumer"
    ]
    assert len(warnings) == 1 and reason in warnings[0] and "tested with" in warnings[0]
    assert pull.stats.acked == registry.metrics().applied


async def test_crash_before_ack_means_redelivery(nc: Client, stream: JetStreamContext) -> None:
    config = durable_config(NS.all_events, "crashy", ack_wait_s=1.0)
    await ensure_consumer(stream, NS.event_stream, config)
    drones = fleet(3)
    for drone in drones:
        await publish_story(stream, drone, 4)
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
        await wait_until(lambda: state_of(second) == expected(drones), what="redelivered")
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

        async def answered() -> bool:
            info = await stream.consumer_info(NS.event_stream, "strict")
            return info.num_ack_pending == 0

        # the server took every answer: nothing waits for an ack, so nothing comes again
        await wait_until_async(answered, what="the server to take the answers")
        assert pull.stats.delivered == 4
    metrics = registry.metrics()
    assert metrics.rejected[Rejection.MALFORMED] == 1
    assert metrics.rejected[Rejection.SENDER] == 2
    assert registry.view(SITE, victim.drone) is None
    view = registry.view(SITE, honest.drone)
    assert view is not None and view.seq == honest.seq - 2  # only its first heartbeat
    info = await stream.consumer_info(NS.event_stream, "strict")
    assert info.num_ack_pending == 0 and info.num_redelivered == 0  # the terms held


async def test_ephemeral_reader_reads_what_was_there(nc: Client, stream: JetStreamContext) -> None:
    from broker.jetstream.reads import read_all

    drones = fleet(3)
    for drone in drones:
        await publish_story(stream, drone, 2)
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

    drones = fleet(3)
    for drone in drones:
        await publish_story(stream, drone, 2)
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
