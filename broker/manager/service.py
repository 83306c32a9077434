"""
The manager side as one long-running service

:class:`ManagerService` owns the connection, the durable consumer on the
event stream, the watch on the handshake bucket, the registry and the
periodic lost-marking. Its :meth:`~ManagerService.run` never returns and never
raises (COBalD aborts the daemon on either): connection and server failures
are logged and retried.

:func:`rebuild` restores a registry after a restart from the stream and the
bucket (``docs/architecture.md``, "Rebuilding the registry"). A drone's state
is its valid event stored last and its valid heartbeat stored last
(:mod:`broker.manager.registry`), so the rebuild reads:

1. the last message of every event subject (a ``LAST_PER_SUBJECT`` consumer
   on ``<prefix>.*.*.evt.>``: one per drone and event kind), applied by stream
   sequence;
2. every message of the few subjects whose last message was invalid, since
   the newest valid one is hidden behind it (bounded by the stream's limit of
   messages per subject);
3. every handshake record.

That is the same state as the live registry's for any stream content. The
durable consumer then carries on from its last acknowledgement; what it
delivers again is dropped by stream sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from broker.errors import BrokerError, ConsumerGone
from broker.jetstream.messages import ConsumerStats, Disposition, Handler, PullSettings, metadata
from broker.jetstream.pull import PullConsumer
from broker.jetstream.reads import read_all
from broker.manager.control import DEFAULT_REQUEST_TIMEOUT_S, Control
from broker.manager.registry import DEFAULT_LOST_AFTER_S, Applied, Registry, relayed
from broker.server.durable import DEFAULT_DURABLE, durable_config, ensure_consumer
from remote_agent.protocol.connect import connect
from remote_agent.protocol.events import EVENT_TYPES, kind_of
from remote_agent.protocol.names import (
    DEFAULT_API_PREFIX,
    EXPECTED_LAST,
    KV_MARKER,
    KV_OPERATION,
    Namespace,
    api_prefix,
    kv_subjects,
)

log = logging.getLogger("broker.service")

#: subjects read by one consumer when resolving messages hidden behind invalid ones
_RESOLVE_SUBJECTS = 100


def event_handler(registry: Registry) -> Handler:
    """
    The consumer's handler: apply each event to ``registry``, then say ack or term

    The event's time of arrival is the time the stream stored it (from the
    reply subject), so a replay after a restart sees the same times.
    Rejected events are termed: redelivering them could never help.
    """
    apply = registry.apply_message
    rejected = Applied.REJECTED
    ack = Disposition.ACK
    term = Disposition.TERM

    def handle(
        subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> Disposition:
        try:
            stream_seq, _, received, _ = metadata(reply)
        except ValueError:  # not from JetStream: nothing to order it by
            return term
        return term if apply(data, subject, received, stream_seq, headers) is rejected else ack

    return handle


# ---------------------------------------------------------------------- records


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
    nc: Client, js: JetStreamContext, registry: Registry, *, api: str = DEFAULT_API_PREFIX
) -> RecordFeed:
    """
    Load every handshake record into ``registry``

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
            filter_subject=ns.all_records,
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


# ---------------------------------------------------------------------- rebuild


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What :func:`rebuild` read, and from where"""

    events: int  #: last messages of event subjects read (one per drone and kind)
    resolved: int  #: subjects read in full because their last message was invalid
    resolved_messages: int  #: messages read for those
    records: int  #: handshake records loaded
    last_seq: int  #: the event stream's last sequence when the rebuild started
    seconds: float  #: in all; then by step
    events_s: float
    resolve_s: float
    records_s: float
    record_next_seq: int = field(default=1)  #: where a record watch continues


async def rebuild(
    nc: Client,
    js: JetStreamContext,
    registry: Registry,
    *,
    api: str = DEFAULT_API_PREFIX,
    pause_gc: bool = True,
) -> tuple[RebuildReport, RecordFeed]:
    """
    Restore ``registry`` from the event stream and the handshake bucket

    Safe to run into a registry that already holds state: everything merges
    by stream sequence and revision.

    :param pause_gc: pause Python's cyclic garbage collector while reading.
        The rebuild allocates hundreds of thousands of acyclic objects that
        all stay alive, and every collection would scan the growing heap
        again (measured: half the decoding time at 100,000 drones). Nothing
        else is changed; the collector is re-enabled afterwards if it was on.
    :returns: what was read, and the record feed to continue watching with
    """
    collecting = pause_gc and gc.isenabled()
    if collecting:
        gc.disable()
    try:
        return await _rebuild(nc, js, registry, api)
    finally:
        if collecting:
            gc.enable()


def event_reader(
    registry: Registry, hidden: set[str] | None
) -> Callable[[str, str, bytes, Mapping[str, str] | None], None]:
    """
    A read_all handler applying events by stream sequence; the subjects of
    rejected messages that may hide a valid one go into ``hidden``
    """
    apply = registry.apply_message
    kinds = frozenset(kind_of(event_type) for event_type in EVENT_TYPES)
    prefix = registry.namespace.prefix

    def on_event(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        stream_seq, _, stored, _ = metadata(reply)
        result = apply(data, subject, stored, stream_seq, headers)
        if result is Applied.REJECTED and hidden is not None:
            parts = subject.split(".")
            # only a subject a valid event can arrive on can hide one
            if len(parts) == 5 and parts[0] == prefix and parts[4] in kinds:
                hidden.add(subject)

    return on_event


async def _rebuild(
    nc: Client, js: JetStreamContext, registry: Registry, api: str
) -> tuple[RebuildReport, RecordFeed]:
    started = time.perf_counter()
    ns = registry.namespace
    stream = ns.event_stream
    last_seq = (await js.stream_info(stream)).state.last_seq
    hidden: set[str] = set()
    events = await read_all(
        nc,
        js,
        stream,
        ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, filter_subject=ns.all_events),
        event_reader(registry, hidden),
        headers=True,
        api=api,
    )
    events_done = time.perf_counter()
    resolved_messages = 0
    subjects = sorted(hidden)
    for first in range(0, len(subjects), _RESOLVE_SUBJECTS):
        resolved_messages += await read_all(
            nc,
            js,
            stream,
            ConsumerConfig(
                deliver_policy=DeliverPolicy.ALL,
                filter_subjects=subjects[first : first + _RESOLVE_SUBJECTS],
            ),
            event_reader(registry, None),
            headers=True,
            api=api,
        )
    resolve_done = time.perf_counter()
    feed = await load_records(nc, js, registry, api=api)
    done = time.perf_counter()
    report = RebuildReport(
        events=events,
        resolved=len(subjects),
        resolved_messages=resolved_messages,
        records=registry.records_applied,
        last_seq=last_seq,
        seconds=done - started,
        events_s=events_done - started,
        resolve_s=resolve_done - events_done,
        records_s=done - resolve_done,
        record_next_seq=feed.next_seq,
    )
    log.info(
        "registry rebuilt in %.2fs: %d drones from %d events (up to seq %d), "
        "%d subjects read in full behind invalid messages, %d records",
        report.seconds,
        len(registry),
        events,
        last_seq,
        len(subjects),
        report.records,
    )
    return report, feed


# ---------------------------------------------------------------------- the service


@dataclass(frozen=True, slots=True)
class ManagerSettings:
    """
    How the manager connects and consumes

    :param servers: NATS URLs (several for a cluster)
    :param creds: NATS credentials file of the manager
    :param domain: JetStream domain (leaf-node deployments)
    :param durable: name of the durable consumer on the event stream
    :param lost_after_s: seconds without a sign of life after which a drone is lost
    :param lost_check_s: how often drones are checked for being lost
    :param retry_s: wait before reconnecting after the connection or the consumer failed
    :param request_timeout_s: how long commands wait for an agent's answer
    """

    servers: Sequence[str] = ("nats://127.0.0.1:4222",)
    creds: str | None = None
    namespace: Namespace = field(default_factory=Namespace)
    domain: str | None = None
    durable: str = DEFAULT_DURABLE
    ack_wait_s: float = 30.0
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    lost_check_s: float = 5.0
    retry_s: float = 5.0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    pull: PullSettings = field(default_factory=PullSettings)


class ManagerService:
    """
    The registry kept current from the bus, and the control API over it

    ``await service.run()`` runs until :meth:`stop` (inside COBalD: forever).
    :attr:`registry` is usable from the start (empty until the first
    rebuild); :attr:`control` once :attr:`ready` is set.
    """

    def __init__(self, settings: ManagerSettings, registry: Registry | None = None) -> None:
        self.settings = settings
        if registry is None:
            registry = Registry(settings.namespace, lost_after_s=settings.lost_after_s)
        self.registry = registry
        self.control: Control | None = None
        self.ready = asyncio.Event()
        self.last_rebuild: RebuildReport | None = None
        self.failures = 0
        #: counters of the event stream's consumer, across reconnects
        self.consumer_stats = ConsumerStats()
        self._stop = asyncio.Event()
        self._pulls: list[PullConsumer] = []
        self._api = api_prefix(settings.domain)

    def stop(self) -> None:
        """Ask :meth:`run` to end (tests and the CLI; COBalD never stops it)"""
        self._stop.set()

    async def run(self) -> None:
        """Connect, rebuild, consume; on any failure log, wait and start over. Never raises."""
        while not self._stop.is_set():
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # never let one failure end the service
                self.failures += 1
                log.warning(
                    "manager session failed, retrying in %.0fs: %s",
                    self.settings.retry_s,
                    _describe(err),
                    exc_info=not isinstance(err, BrokerError | nats.errors.Error | OSError),
                )
            finally:
                self.ready.clear()
                self.control = None
            if not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.retry_s)

    async def _session(self) -> None:
        settings = self.settings
        nc = await connect(
            list(settings.servers),
            name="cobald-remote-manager",
            user_credentials=settings.creds,
            # fail the first connect after a few tries (the loop retries it, and
            # can be stopped meanwhile); once connected, reconnect forever
            max_reconnect_attempts=3,
            reconnect_time_wait=1.0,
            connect_timeout=5,
            reconnected_cb=self._reconnected,
            disconnected_cb=self._disconnected,
            error_cb=self._error,
        )
        nc.options["max_reconnect_attempts"] = -1  # read on every reconnect (-1: forever)
        try:
            js = nc.jetstream(domain=settings.domain)
            ns = self.registry.namespace
            config = durable_config(ns.all_events, settings.durable, ack_wait_s=settings.ack_wait_s)
            # create the durable before the rebuild reads the stream's end, so
            # no event falls between the two
            await ensure_consumer(js, ns.event_stream, config)
            # the proof key first: the rebuild checks the records' proofs with it
            control = await Control.open(
                nc,
                self.registry,
                domain=settings.domain,
                request_timeout_s=settings.request_timeout_s,
            )
            report, feed = await rebuild(nc, js, self.registry, api=self._api)
            self.last_rebuild = report
            self.control = control
            consumer = PullConsumer(
                nc,
                ns.event_stream,
                settings.durable,
                event_handler(self.registry),
                headers=True,  # a relayed answer is told by its headers (registry.relayed)
                settings=settings.pull,
                api=self._api,
                stats=self.consumer_stats,
            )
            self._pulls.append(consumer)
            self.ready.set()
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(consumer.run(self._stop)),
                        tg.create_task(
                            watch_records(
                                nc, js, feed, self._stop, api=self._api, on_pull=self._pulls
                            )
                        ),
                        tg.create_task(self._mark_lost()),
                    ]
                    await self._stop.wait()
                    for task in tasks:
                        task.cancel()
            finally:
                self._pulls.clear()
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _mark_lost(self) -> None:
        while not self._stop.is_set():
            self.registry.mark_lost(time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.lost_check_s)

    async def _reconnected(self) -> None:
        log.info("reconnected to NATS")
        for pull in list(self._pulls):
            await pull.reconnected()

    async def _disconnected(self) -> None:
        # nats-py calls this on close, too
        if self._stop.is_set():
            log.info("disconnected from NATS: stopping")
        else:
            log.warning("disconnected from NATS; reconnecting")

    async def _error(self, err: Exception) -> None:
        log.debug("nats: %r", err)


def _describe(err: BaseException) -> str:
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in err.exceptions)
    return f"{type(err).__name__}: {err}"
