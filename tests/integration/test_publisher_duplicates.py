"""
What the agent's publisher makes of the stream's ``duplicate`` answer, on a real server

A duplicate after this process had sent the event (a retry after a failure) means the
stream has it; one on the first attempt means another message holds the id, and the event
is published again under a fresh id. An event an earlier run left in the spool counts as
never sent: stored by that run, it is stored twice, which the manager takes in its stride.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from nats.js import JetStreamContext
from support.agent import NS, SITE, read_events
from support.drones import FakeDrone, publish
from support.waiting import wait_until

from broker.manager.registry import Registry
from broker.server.embedded import EmbeddedServer
from broker.tardis.release import Durations
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import MSG_ID
from remote_agent.publisher import Publisher
from remote_agent.spool import Spool, SpooledEvent

DRONE = "site1-00000000ab"


def spooled(event: ev.Event) -> SpooledEvent:
    kind = ev.kind_of(type(event))
    return SpooledEvent(
        id=event.id,
        seq=event.seq,
        kind=kind,
        subject=NS.event(SITE, event.drone, kind),
        data=ev.encode(event),
    )


@contextlib.asynccontextmanager
async def publishing(spool: Spool, url: str, **options: float) -> AsyncIterator[Publisher]:
    publisher = Publisher(spool, [url], **options)
    task = asyncio.create_task(publisher.run())
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await publisher.close()


async def test_a_retry_that_comes_back_duplicate_was_stored(
    tmp_path: Path, nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    event = FakeDrone(SITE, DRONE).heartbeat()
    with Spool.open(tmp_path / "spool") as spool:
        spool.append(spooled(event))
        # no answer is ever awaited long enough: every publish fails, yet reaches the server
        async with publishing(spool, nats_server.url, publish_timeout_s=1e-9) as publisher:
            await wait_until(lambda: publisher.retries >= 1, what="a publish that timed out")
            publisher.publish_timeout_s = 5.0
            publisher.wake()
            await wait_until(lambda: not len(spool), what="the event acknowledged")
    assert (publisher.published, publisher.duplicates, publisher.taken) == (1, 1, 0)
    assert [msg_id for msg_id, _ in await read_events(stream, DRONE)] == [event.id]


async def test_an_event_an_earlier_run_stored_is_stored_again_and_counted_once(
    tmp_path: Path, nats_server: EmbeddedServer, stream: JetStreamContext
) -> None:
    drone = FakeDrone(SITE, DRONE)
    started = drone.payload_started("1.0")
    finished = drone.payload_finished("1.0")
    finished = ev.PayloadFinished(
        **{f: getattr(finished, f) for f in finished.__struct_fields__ if f != "duration_s"},
        duration_s=60.0,
    )
    await publish(stream, NS, started)
    await publish(stream, NS, finished)  # the earlier run stored it, then died before its ack
    with Spool.open(tmp_path / "spool") as spool:
        spool.append(spooled(finished))
        async with publishing(spool, nats_server.url) as publisher:
            await wait_until(lambda: not len(spool), what="the spool sent")
    assert (publisher.published, publisher.duplicates, publisher.taken) == (1, 0, 1)
    stored = await read_events(stream, DRONE)
    assert [event.seq for _, event in stored] == [started.seq, finished.seq, finished.seq]
    assert stored[2][0].startswith(f"{finished.id}:")
    # the manager: the same state, and one payload end for the estimate
    registry = Registry(NS)
    durations = Durations()
    registry.watchers.append(durations.seen)
    for stream_seq, (msg_id, event) in enumerate(stored, start=1):
        subject = NS.event(SITE, DRONE, ev.kind_of(type(event)))
        registry.apply_message(ev.encode(event), subject, 1.0, stream_seq, {MSG_ID: msg_id})
    assert registry.metrics().applied == 3
    view = registry.view(SITE, DRONE)
    assert view is not None and view.seq == finished.seq and view.payloads == []
    assert len(durations) == 1
