"""
Restore a registry after a restart from the handshake bucket and the event stream

Its rule: the work is bounded by the live fleet and the ended drones not yet retired, not
by history. The rebuild loads every handshake record (the bucket holds only drones not yet
retired), reads every event and TARDIS note stored in the last few heartbeat intervals,
then reads the newest messages of the drones that window leaves incomplete, ended drones
kept longer than the window among them (``docs/architecture.md``, "Rebuilding after a
restart"). The result equals the live registry's for every drone that has a record or
spoke within the window.
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from broker.jetstream.reads import read_all
from broker.manager.handler import event_reader
from broker.manager.records import RecordFeed, load_records
from broker.manager.registry import Registry
from remote_agent.protocol.names import DEFAULT_API_PREFIX

log = logging.getLogger("cobald.runtime.cobald_remote.service")

#: the window read in full, in multiples of the registry's ``lost_after_s``: a live
#: agent's heartbeat (its whole snapshot) is in it however its clock runs
WINDOW_LOST_AFTER: float = 2.0
#: subjects read by one consumer when reading drones one by one or resolving
_RESOLVE_SUBJECTS = 100


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What :func:`rebuild` read, and from where"""

    events: int  #: messages read: the window's, the incomplete drones' and the resolved
    resolved: int  #: subjects read in full because their last message was invalid
    resolved_messages: int  #: messages read for those
    records: int  #: handshake records loaded
    last_seq: int  #: the event stream's last sequence when the rebuild started
    seconds: float  #: in all; then by step
    events_s: float
    resolve_s: float
    records_s: float
    record_next_seq: int = field(default=1)  #: where a record watch continues
    window_s: float = 0.0  #: the window read in full, seconds before the rebuild
    window_messages: int = 0  #: messages stored in the window (events and notes)
    drones_read: int = 0  #: drones the window left incomplete, read one by one
    drone_messages: int = 0  #: newest messages read for those


async def rebuild(
    nc: Client,
    js: JetStreamContext,
    registry: Registry,
    *,
    api: str = DEFAULT_API_PREFIX,
    pause_gc: bool = True,
    window_s: float | None = None,
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
    :param window_s: seconds of the stream read in full (default :data:`WINDOW_LOST_AFTER`
        times the registry's ``lost_after_s``): a drone without a handshake record is
        found only if it sent something in them
    :returns: what was read, and the record feed to continue watching with
    """
    collecting = pause_gc and gc.isenabled()
    if collecting:
        gc.disable()
    try:
        with registry.replaying():
            return await _rebuild(nc, js, registry, api, window_s)
    finally:
        if collecting:
            gc.enable()


async def _rebuild(
    nc: Client, js: JetStreamContext, registry: Registry, api: str, window_s: float | None
) -> tuple[RebuildReport, RecordFeed]:
    started = time.perf_counter()
    ns = registry.namespace
    stream = ns.event_stream
    last_seq = (await js.stream_info(stream)).state.last_seq
    feed = await load_records(nc, js, registry, api=api)
    records_done = time.perf_counter()
    if window_s is None:
        window_s = WINDOW_LOST_AFTER * registry.lost_after_s
    since = dt.datetime.fromtimestamp(time.time() - window_s, dt.UTC)
    rejected: set[str] = set()
    window = await read_all(
        nc,
        js,
        stream,
        ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since,
            # no filter: the stream holds exactly the events and the notes, and a
            # consumer filtered by two subjects is served far slower
        ),
        event_reader(registry, rejected),
        headers=True,
        api=api,
    )
    views = registry.views()
    # only drones known by now (a record, or a valid message in the window) are read one
    # by one: subjects any sender may have had the server store for a made-up drone cost
    # the rebuild nothing beyond the window
    roots = {
        ns.drone_root(view.site, view.drone)
        for view in views.values()
        if view.heartbeat_stream_seq is None
    }
    known = {ns.drone_root(site, drone) for site, drone in views}
    roots.update(root for root in map(_drone_root, rejected) if root in known)
    hidden: set[str] = set()
    drone_messages = await _read_each(
        nc,
        js,
        registry,
        sorted(f"{root}.>" for root in roots),
        DeliverPolicy.LAST_PER_SUBJECT,
        hidden,
        api,
    )
    events_done = time.perf_counter()
    subjects = sorted(hidden)
    resolved_messages = await _read_each(nc, js, registry, subjects, DeliverPolicy.ALL, None, api)
    done = time.perf_counter()
    registry.rescan()
    registry.mark_ended(time.time())
    report = RebuildReport(
        events=window + drone_messages + resolved_messages,
        resolved=len(subjects),
        resolved_messages=resolved_messages,
        records=registry.records_applied,
        last_seq=last_seq,
        seconds=done - started,
        events_s=events_done - records_done,
        resolve_s=done - events_done,
        records_s=records_done - started,
        record_next_seq=feed.next_seq,
        window_s=window_s,
        window_messages=window,
        drones_read=len(roots),
        drone_messages=drone_messages,
    )
    log.info(
        "registry rebuilt in %.2fs: %d drones from %d records, %d messages of the last "
        "%.0fs and the newest of %d drones one by one (up to seq %d), "
        "%d subjects read in full behind invalid messages",
        report.seconds,
        len(registry),
        report.records,
        window,
        window_s,
        len(roots),
        last_seq,
        len(subjects),
    )
    return report, feed


def _drone_root(subject: str) -> str:
    """``<prefix>.<site>.<drone>`` of a subject under a drone (its first three tokens)"""
    return ".".join(subject.split(".", 3)[:3])


async def _read_each(
    nc: Client,
    js: JetStreamContext,
    registry: Registry,
    subjects: Iterable[str],
    policy: DeliverPolicy,
    hidden: set[str] | None,
    api: str,
) -> int:
    """Read ``subjects`` by ``policy``, a batch of them per consumer"""
    subjects = list(subjects)
    read = 0
    for first in range(0, len(subjects), _RESOLVE_SUBJECTS):
        read += await read_all(
            nc,
            js,
            registry.namespace.event_stream,
            ConsumerConfig(
                deliver_policy=policy,
                filter_subjects=subjects[first : first + _RESOLVE_SUBJECTS],
            ),
            event_reader(registry, hidden),
            headers=True,
            api=api,
        )
    return read
