"""
The handshake bucket's feed into the registry: load every record, then watch for changes

Its rule: every record write is a compare-and-set, so a value without that header,
a relayed server answer or a delete marker makes the drone's record tampered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from broker.errors import ConsumerGone
from broker.jetstream.messages import Disposition, PullSettings, metadata
from broker.jetstream.pull import PullConsumer
from broker.jetstream.reads import read_all
from broker.manager.registry import Registry
from broker.manager.validity import relayed
from remote_agent.protocol.names import (
    DEFAULT_API_PREFIX,
    EXPECTED_LAST,
    KV_MARKER,
    KV_OPERATION,
    kv_subjects,
)

log = logging.getLogger("cobald.runtime.cobald_remote.service")


class RecordFeed:
    """
    Applies handshake-bucket messages to the registry, remembering how far it got

    :param prefix: ``$KV.<bucket>.``; the rest of each subject is the key
    """

    def __init__(self, registry: Registry, bucket: str) -> None:
        self.registry = registry
        self.prefix = kv_subjects(bucket)
        self.next_seq = 1

    def __call__(
        self, subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> Disposition:
        seq, _, stored, _ = metadata(reply)
        self.next_seq = max(self.next_seq, seq + 1)
        key = subject.removeprefix(self.prefix)
        how = headers and (headers.get(KV_OPERATION) or headers.get(KV_MARKER))
        if relayed(headers):  # before the markers: a relayed marker is no marker
            self.registry.record_relayed(key, seq, stored, "a server's answer, relayed")
        elif how:
            self.registry.record_removed(key, seq, stored, str(how)[:40])
        elif not headers or EXPECTED_LAST not in headers:
            # every record write is a compare-and-set; a value without it is a
            # server's answer asked for without headers (a direct get with no_hdr)
            self.registry.record_relayed(key, seq, stored, f"stored without {EXPECTED_LAST}")
        else:
            self.registry.apply_record_message(key, data, seq, stored)
        return Disposition.ACK


async def load_records(
    nc: Client,
    js: JetStreamContext,
    registry: Registry,
    *,
    api: str = DEFAULT_API_PREFIX,
    subject: str | None = None,
) -> RecordFeed:
    """
    Load every handshake record into ``registry``

    :param subject: only the records on this subject (one drone's), not all
    :returns: the feed, whose ``next_seq`` is where a watch for later changes starts
    """
    ns = registry.namespace
    stream = ns.record_stream
    feed = RecordFeed(registry, ns.record_bucket)
    last = (await js.stream_info(stream)).state.last_seq
    await read_all(
        nc,
        js,
        stream,
        ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            filter_subject=subject or ns.all_records,
        ),
        feed,
        headers=True,
        api=api,
    )
    feed.next_seq = max(feed.next_seq, last + 1)
    return feed


async def watch_records(
    nc: Client,
    js: JetStreamContext,
    feed: RecordFeed,
    stop: asyncio.Event,
    *,
    api: str = DEFAULT_API_PREFIX,
    settings: PullSettings | None = None,
    on_pull: list[PullConsumer] | None = None,
) -> None:
    """
    Apply every later change of the handshake bucket until ``stop`` is set

    An ephemeral ``AckPolicy.NONE`` consumer from ``feed.next_seq``; when the
    server loses it (a restart, a long disconnect) it is created again from
    where the feed got to.
    """
    ns = feed.registry.namespace
    stream = ns.record_stream
    settings = settings or PullSettings(batch=200, expires_s=5.0, idle_heartbeat_s=1.0)
    while not stop.is_set():
        try:
            info = await js.add_consumer(
                stream,
                ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=feed.next_seq,
                    ack_policy=AckPolicy.NONE,
                    filter_subject=ns.all_records,
                    inactive_threshold=30.0,
                    mem_storage=True,
                    num_replicas=1,
                ),
            )
        except (nats.errors.Error, TimeoutError) as err:  # JetStream not back yet
            log.info("cannot watch the handshake bucket yet (%s); retrying", err)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.idle_heartbeat_s)
            continue
        pull = PullConsumer(
            nc, stream, info.name, feed, acks=False, headers=True, settings=settings, api=api
        )
        if on_pull is not None:
            on_pull.append(pull)
        try:
            await pull.run(stop)
        except ConsumerGone as err:
            log.info("record watch lost its consumer (%s); creating it again", err)
        finally:
            if on_pull is not None:
                on_pull.remove(pull)
            if stop.is_set():
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await js.delete_consumer(stream, info.name)
