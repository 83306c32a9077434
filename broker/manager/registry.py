"""
The drone registry: the manager's latest knowledge of every drone (pure state, no I/O)

Every event carries the whole snapshot it led to, so the registry keeps, per
drone, only the newest valid event and the times that say how old each fact
is. "Newest" is the order in which the event stream *stored* the events, its
stream sequence: the server assigns it, no drone can forge it, and it is the
same whether an event is consumed live, delivered again, or read by a rebuild.
An event stored earlier than the one known is stale (a redelivery or a replay)
and is counted and dropped, so lost, repeated and reordered deliveries converge
to the same state. The agent's own ``seq`` orders its events for people (the
timeline) and makes its dedupe ids; a wrong or forged one cannot hide events
stored later, and a restarted agent's events supersede an earlier incarnation's.

An event is valid if it passes the strict decoder and speaks for the drone and
kind of its subject (:func:`check_event`); whether a message is valid depends
on its subject and bytes alone. So the state of a drone is a function of its
stored messages: the valid one stored last, and the valid heartbeat stored last.

The newest event is kept as the bytes that came off the stream, validated in
full on arrival, beside the few facts readers need at once (``seq``, kind,
the drone's state); the rest is decoded when someone reads it. A drone
running eight payloads then costs about a kilobyte instead of the 2.7 KB of
the decoded event, and replacing a drone's state frees one object instead of
a tree of them (``bench/scale.py``, ``bench/ingest.py``). Handshake records
from the KV bucket are merged by revision in the same way; a removed or
invalid record is kept as *tampered* (:attr:`RecordView.tampered`), never
forgotten, since its drone may be up.

Times are seconds since the epoch (UTC) and come from the caller: the
consumer passes the time at which JetStream *stored* each message, which is
the same whether the event is consumed live or replayed after a restart, so a
rebuilt registry equals the one that was lost.

Readers on other threads (the TARDIS integration) call :meth:`Registry.view`
and :meth:`Registry.views`: every :class:`DroneView` is immutable and is
replaced, never changed, with one dictionary store, which CPython performs
atomically; :meth:`Registry.views` returns a copy taken in one step.
"""

from __future__ import annotations

import enum
import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import msgspec

from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import (
    DEFAULT_MAX_SIZE,
    EVENT_TYPES,
    SCHEMA_VERSION,
    AnyEvent,
    DrainIntent,
    DroneRecord,
    DroneState,
    Heartbeat,
    Payload,
    RecordPhase,
    Snapshot,
    decode_event,
    decode_record,
    encode,
    kind_of,
)
from remote_agent.protocol.handshake import proven
from remote_agent.protocol.names import MSG_ID, RELAY_HEADERS, Namespace, is_token
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("broker.registry")
_rejections = RateLimitedLog(log)

#: default time without any event after which a drone counts as lost: three
#: heartbeats of the agent's default 30 s interval
DEFAULT_LOST_AFTER_S: Final = 90.0

_KINDS: Final = {event_type: kind_of(event_type) for event_type in EVENT_TYPES}
_decode = msgspec.msgpack.Decoder(AnyEvent).decode


class Applied(enum.StrEnum):
    """What :meth:`Registry.apply` did with one event"""

    APPLIED = "applied"  #: newer than anything known: the drone's state is now this event's
    DUPLICATE = "duplicate"  #: same ``seq`` as the newest known event
    STALE = "stale"  #: older ``seq`` than the newest known event
    REJECTED = "rejected"  #: invalid; see the counted reason


class Rejection(enum.StrEnum):
    """Why an event or record was rejected (the label of its counter)"""

    OVERSIZED = "oversized"  #: larger than the configured limit
    MALFORMED = "malformed"  #: not a valid message of the schema (type, field, version)
    SUBJECT = "subject"  #: arrived on a subject that is not an event subject of ours
    SENDER = "sender"  #: the body speaks for another drone or kind than its subject
    RECORD = "record"  #: a KV value that is not a valid record for its key
    RELAYED = "relayed"  #: a server's answer that a reply subject sent onto this subject


class Unstored(enum.Enum):
    """A message that did not come off a stream (tests, tools): no headers to check"""

    UNSTORED = "unstored"


UNSTORED: Final = Unstored.UNSTORED
Headers = Mapping[str, str] | None | Unstored


def relayed(headers: Mapping[str, str] | None) -> bool:
    """Whether a stored message with ``headers`` is a server's answer relayed onto its subject"""
    return headers is not None and not RELAY_HEADERS.isdisjoint(headers)


def published_by_writer(headers: Mapping[str, str] | None, message_id: str) -> bool:
    """
    Whether a stored message is its writer's own publish: no server answer headers, and
    the ``Nats-Msg-Id`` its writer sends (``message_id``, the message's ``id``)
    """
    return (
        headers is not None
        and headers.get(MSG_ID) == message_id
        and RELAY_HEADERS.isdisjoint(headers)
    )


class Rejected(Exception):
    """A message that is not valid; nothing of it may change any state"""

    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_event(
    data: bytes,
    subject: str,
    prefix: str,
    max_size: int = DEFAULT_MAX_SIZE,
    headers: Headers = UNSTORED,
) -> AnyEvent:
    """
    The event in ``data`` if it is valid as it arrived on ``subject`` with ``headers``

    Valid means: at most ``max_size`` bytes, a message of the schema (strict
    decoding, see :func:`remote_agent.protocol.events.decode_event`), speaking for the
    site, drone and kind that its subject names, and, when it came off the
    stream, stored as its writer published it (:func:`published_by_writer`).
    Depends on nothing else, so the live registry, a rebuild and the timeline
    all accept the same events.

    :param headers: the headers it was stored with (``None``: none), or
        :data:`UNSTORED` for an event that did not come off a stream
    :raises Rejected: with the reason otherwise
    """
    if headers is not UNSTORED and relayed(headers):
        raise Rejected(Rejection.RELAYED, "a server's answer, relayed by a reply subject")
    if len(data) > max_size:
        raise Rejected(
            Rejection.OVERSIZED, f"{len(data)} bytes exceed the limit of {max_size} bytes"
        )
    try:
        # the same strict decoder as events.decode_event, without its wrapper;
        # anything it does not accept goes through decode_event for the reason
        event = _decode(data)
        if event.v != SCHEMA_VERSION:
            raise msgspec.ValidationError
    except Exception:
        try:
            event = decode_event(data, max_size)
        except SchemaError as err:
            raise Rejected(Rejection.MALFORMED, str(err)) from None
    # the sender check of events.check_sender, inlined: this runs per message.
    # Site and drone are tokens (no dots), so one comparison of the whole
    # subject says the same as comparing its parts; only a mismatch is split
    kind = _KINDS[type(event)]
    if subject != f"{prefix}.{event.site}.{event.drone}.evt.{kind}":
        parts = subject.split(".")
        if len(parts) != 5 or parts[0] != prefix or parts[3] != "evt":
            raise Rejected(Rejection.SUBJECT, "not an event subject")
        raise Rejected(
            Rejection.SENDER,
            f"event {kind!r} for {event.site}/{event.drone} arrived on the subject of "
            f"{parts[1]}/{parts[2]} ({parts[4]!r})",
        )
    if headers is not UNSTORED and not published_by_writer(headers, event.id):
        raise Rejected(Rejection.RELAYED, f"stored without its writer's {MSG_ID}")
    return event


class RecordView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """
    The drone's handshake record as last seen in the KV bucket

    A record that was deleted or purged, or whose value is no valid record of
    its drone, is *tampered*: ``phase`` is ``None`` and :attr:`tampered` says
    what was found. Neither side writes that, and the drone may be up.
    """

    phase: RecordPhase | None
    writer: str
    revision: int
    incarnation: str = ""
    drain: DrainIntent | None = None
    at: float  #: when the writer wrote it (its clock), epoch seconds
    #: when the bucket stored it, epoch seconds; ``None`` until the KV watch
    #: confirms a record that the manager merged from its own read or write
    stored: float | None = None
    note: str = ""
    #: the record carries the manager's valid proof (its phases count only then)
    proven: bool = False
    #: why the record is not a valid record of its drone (``""``: it is one)
    tampered: str = ""

    @property
    def label(self) -> str:
        """The phase for people and metrics: ``tampered`` for a record that is none"""
        return "tampered" if self.phase is None else str(self.phase)


class DroneView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """
    Everything the manager knows about one drone, with the age of each fact

    Immutable: the registry replaces a drone's view, it never changes one.
    All ``*_time`` fields are epoch seconds (UTC); ``None`` means "never".
    """

    site: str
    drone: str
    #: the newest valid event (stored last in the stream) as it came off the
    #: stream, MessagePack that passed the strict decoder; ``None`` if only the
    #: record is known
    encoded: bytes | None = None
    #: the agent's ``seq``, ``kind`` and the snapshot's drone state of that event
    seq: int | None = None
    kind: str = ""
    state: DroneState | None = None
    #: its stream sequence, and when it reached the bus
    stream_seq: int | None = None
    received_time: float | None = None
    #: the newest valid heartbeat: the agent's ``seq``, its stream sequence, when
    #: it reached the bus, and its interval; kept even if it was delivered after
    #: a newer event
    heartbeat_seq: int | None = None
    heartbeat_stream_seq: int | None = None
    heartbeat_time: float | None = None
    heartbeat_interval_s: float | None = None
    record: RecordView | None = None
    #: set by :meth:`Registry.mark_lost`, cleared by the next event
    lost: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.site, self.drone)

    @property
    def event(self) -> AnyEvent | None:
        """
        The newest event, decoded anew on every access (keep the result if
        you need several of its fields)
        """
        return _decode(self.encoded) if self.encoded is not None else None

    @property
    def incarnation(self) -> str:
        """The agent run that sent the newest event"""
        event = self.event
        return event.incarnation if event is not None else ""

    @property
    def snapshot(self) -> Snapshot | None:
        """The drone's state right after its newest event (decoded on every access)"""
        event = self.event
        return event.snapshot if event is not None else None

    @property
    def event_time(self) -> float | None:
        """The agent's clock when it recorded the newest event, epoch seconds"""
        event = self.event
        return event.at.timestamp() if event is not None else None

    @property
    def payloads(self) -> list[Payload]:
        snapshot = self.snapshot
        return list(snapshot.payloads) if snapshot is not None else []

    @property
    def phase(self) -> RecordPhase | None:
        return self.record.phase if self.record is not None else None

    @property
    def last_seen(self) -> float | None:
        """
        The newest sign of life of the agent: its newest event, or a record it wrote

        A record written by the manager says nothing about the agent.
        """
        times = [self.received_time, self.heartbeat_time]
        if self.record is not None and self.record.writer == "agent":
            times.append(self.record.stored)
        known = [t for t in times if t is not None]
        return max(known) if known else None

    def last_fact_age_s(self, now: float) -> float | None:
        """Seconds since the newest fact of any kind (event or record)"""
        times = [self.received_time, self.record.stored if self.record else None]
        known = [t for t in times if t is not None]
        return now - max(known) if known else None

    def is_lost(self, now: float, lost_after_s: float) -> bool:
        """
        Whether no sign of life came for ``lost_after_s`` seconds before ``now``

        A drone never heard from (no event, no record of its agent) is not
        lost: it is unknown, and has to be released, not given up on.
        """
        seen = self.last_seen
        return seen is not None and now - seen >= lost_after_s


@dataclass(frozen=True, slots=True)
class Metrics:
    """Counters since the registry was created (Prometheus counters, by label)"""

    applied: int
    duplicate: int
    stale: int
    rejected: Mapping[str, int]
    records_applied: int
    records_ignored: int
    drones: int
    lost: int

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class Registry:
    """
    Latest state per drone, fed with events and handshake records

    :param namespace: subjects the events must arrive on
    :param lost_after_s: seconds without any sign of life after which
        :meth:`mark_lost` marks a drone lost
    :param max_message_bytes: larger messages are rejected unread
    """

    def __init__(
        self,
        namespace: Namespace | None = None,
        *,
        lost_after_s: float = DEFAULT_LOST_AFTER_S,
        max_message_bytes: int = DEFAULT_MAX_SIZE,
    ) -> None:
        if not (lost_after_s > 0 and math.isfinite(lost_after_s)):
            raise ValueError(f"lost_after_s must be a positive number, not {lost_after_s!r}")
        self.namespace = namespace or Namespace()
        self.lost_after_s = lost_after_s
        self.max_message_bytes = max_message_bytes
        self._views: dict[tuple[str, str], DroneView] = {}
        self._prefix = self.namespace.prefix
        self.applied = 0
        self.duplicate = 0
        self.stale = 0
        self.rejected: dict[str, int] = dict.fromkeys(Rejection, 0)
        self.records_applied = 0
        self.records_ignored = 0
        #: the manager's record proof key; records prove the manager's phases with it
        self.proof_key: bytes | None = None

    # ------------------------------------------------------------------ readers

    def view(self, site: str, drone: str) -> DroneView | None:
        """The current view of one drone, or ``None`` if nothing is known about it"""
        return self._views.get((site, drone))

    def views(self) -> Mapping[tuple[str, str], DroneView]:
        """A consistent, read-only copy of every view, keyed by ``(site, drone)``"""
        return MappingProxyType(self._views.copy())  # dict.copy() runs under the GIL

    def __len__(self) -> int:
        return len(self._views)

    def metrics(self) -> Metrics:
        views = self._views.copy()
        return Metrics(
            applied=self.applied,
            duplicate=self.duplicate,
            stale=self.stale,
            rejected=MappingProxyType({str(k): v for k, v in self.rejected.items()}),
            records_applied=self.records_applied,
            records_ignored=self.records_ignored,
            drones=len(views),
            lost=sum(view.lost for view in views.values()),
        )

    # ------------------------------------------------------------------ events

    def reject(self, reason: Rejection, subject: str, error: object) -> Applied:
        """Count and log (rate-limited) a rejected message; nothing else changes"""
        self.rejected[reason] += 1
        _rejections.warning(
            reason, "rejected %s on %s: %s", reason, subject, error, extra={"subject": subject}
        )
        return Applied.REJECTED

    def apply_message(
        self,
        data: bytes,
        subject: str,
        received_time: float,
        stream_seq: int | None = None,
        headers: Headers = UNSTORED,
    ) -> Applied:
        """
        Check and apply one event as it came off the stream

        Never raises for bad input: an invalid message (:func:`check_event`) is
        counted under its :class:`Rejection` reason, logged, and changes no state.

        :param received_time: when the stream stored it (epoch seconds)
        :param stream_seq: its stream sequence; ``None`` (no stream: tests, tools)
            takes it for newer than anything known about its drone
        :param headers: the headers it was stored with; :data:`UNSTORED` for an
            event that did not come off a stream (nothing to check)
        """
        try:
            event = check_event(data, subject, self._prefix, self.max_message_bytes, headers)
        except Rejected as err:
            return self.reject(err.reason, subject, err.detail)
        return self._apply(event, data, received_time, stream_seq)

    def apply(
        self,
        event: AnyEvent,
        subject: str,
        received_time: float,
        stream_seq: int | None = None,
    ) -> Applied:
        """
        Apply one decoded event that arrived on ``subject`` (see :meth:`apply_message`)

        :returns: whether it changed the drone's state, and if not, why not
        """
        return self.apply_message(encode(event), subject, received_time, stream_seq)

    def _apply(
        self, event: AnyEvent, data: bytes, received_time: float, stream_seq: int | None
    ) -> Applied:
        """Apply the valid ``event`` decoded from ``data``, which the view keeps"""
        key = (event.site, event.drone)
        old = self._views.get(key)
        heartbeat = isinstance(event, Heartbeat)
        if old is not None:
            known = old.stream_seq
            if stream_seq is None:
                stream_seq = max(known or 0, old.heartbeat_stream_seq or 0) + 1
            if known is not None and stream_seq <= known:
                if heartbeat and (
                    old.heartbeat_stream_seq is None or stream_seq > old.heartbeat_stream_seq
                ):
                    # the newest heartbeat is a fact of its own, whatever order it came in
                    self._views[key] = msgspec.structs.replace(
                        old,
                        heartbeat_seq=event.seq,
                        heartbeat_stream_seq=stream_seq,
                        heartbeat_time=received_time,
                        heartbeat_interval_s=event.interval_s,  # type: ignore[union-attr]
                    )
                if stream_seq == known:
                    self.duplicate += 1
                    return Applied.DUPLICATE
                self.stale += 1
                return Applied.STALE
            # the strings of the old view serve on: the event's copies are freed with it
            site, drone, record = old.site, old.drone, old.record
            beat_seq, beat_stream, beat_time, beat_interval = (
                old.heartbeat_seq,
                old.heartbeat_stream_seq,
                old.heartbeat_time,
                old.heartbeat_interval_s,
            )
        else:
            if stream_seq is None:
                stream_seq = 1
            site = sys.intern(event.site)  # a site name repeats for thousands of drones
            drone = event.drone
            key = (site, drone)
            record = None
            beat_seq = beat_stream = beat_time = beat_interval = None
        if heartbeat:
            beat_seq, beat_stream, beat_time = event.seq, stream_seq, received_time
            beat_interval = event.interval_s  # type: ignore[union-attr]
        self._views[key] = DroneView(
            site=site,
            drone=drone,
            encoded=data,
            seq=event.seq,
            kind=_KINDS[type(event)],
            state=event.snapshot.state,
            stream_seq=stream_seq,
            received_time=received_time,
            heartbeat_seq=beat_seq,
            heartbeat_stream_seq=beat_stream,
            heartbeat_time=beat_time,
            heartbeat_interval_s=beat_interval,
            record=record,
        )
        self.applied += 1
        return Applied.APPLIED

    # ------------------------------------------------------------------ records

    def _record_key(self, key: str) -> tuple[str, str] | None:
        site, dot, drone = key.partition(".")
        return (site, drone) if dot and is_token(site) and is_token(drone) else None

    def apply_record_message(
        self, key: str, data: bytes, revision: int, stored_time: float
    ) -> Applied:
        """
        Merge one value of the handshake bucket (from a KV watch)

        Ignores revisions not newer than the known one. A value that is not a
        valid record, or one whose site or drone disagree with its key, is
        rejected, counted as :attr:`Rejection.RECORD`, and makes the drone's
        record *tampered*: it replaced whatever was there (the bucket keeps
        one value per key), so the registry does not pretend to know better.
        A key that names no drone changes nothing.
        """
        target = self._record_key(key)
        if target is None:
            return self.reject(Rejection.RECORD, key, "not a <site>.<drone> key")
        try:
            record = decode_record(data, self.max_message_bytes)
            if (record.site, record.drone) != target:
                raise SchemaError(f"record of {record.site}/{record.drone} under key {key!r}")
        except SchemaError as err:
            self.reject(Rejection.RECORD, key, err)
            self._tamper(target, revision, stored_time, "invalid value")
            return Applied.REJECTED
        return self.apply_record(record, revision, stored_time)

    def apply_record(
        self, record: DroneRecord, revision: int, stored_time: float | None
    ) -> Applied:
        """
        Merge a decoded handshake record at ``revision`` (the KV revision)

        :param stored_time: when the bucket stored it (from the KV watch), or
            ``None`` for a record the manager just read or wrote itself
        """
        key = (record.site, record.drone)
        old = self._views.get(key)
        if old is not None and old.record is not None and old.record.revision >= revision:
            if old.record.revision == revision and old.record.stored is None and stored_time:
                confirmed = msgspec.structs.replace(old.record, stored=stored_time)
                self._views[key] = msgspec.structs.replace(old, record=confirmed)
            self.records_ignored += 1
            return Applied.DUPLICATE if old.record.revision == revision else Applied.STALE
        new_record = RecordView(
            phase=record.phase,
            writer=record.writer,
            revision=revision,
            incarnation=record.incarnation,
            drain=record.drain,
            at=record.at.timestamp(),
            stored=stored_time,
            note=record.note,
            proven=proven(self.proof_key, record),
        )
        if old is None:
            old = DroneView(site=sys.intern(record.site), drone=record.drone)
        self._views[key] = msgspec.structs.replace(old, record=new_record)
        self.records_applied += 1
        return Applied.APPLIED

    def record_relayed(self, key: str, revision: int, stored_time: float, why: str) -> Applied:
        """
        A value on ``key`` that no writer of records published (a server's answer
        relayed there, :func:`relayed`): the record is tampered

        It replaced the drone's record in the bucket; whatever it says, it is
        nobody's word about the drone.
        """
        target = self._record_key(key)
        if target is None:
            return self.reject(Rejection.RELAYED, key, "not a <site>.<drone> key")
        self.reject(Rejection.RELAYED, key, why)
        self._tamper(target, revision, stored_time, "relayed by the server")
        return Applied.REJECTED

    def record_removed(self, key: str, revision: int, stored_time: float, how: str) -> Applied:
        """
        A delete or purge marker of ``key`` at ``revision``: the record is tampered

        Neither side removes records, and a removed record is no sign that the
        drone never came up; the drone keeps a tampered record.
        """
        target = self._record_key(key)
        if target is None:
            return self.reject(Rejection.RECORD, key, "not a <site>.<drone> key")
        self.reject(Rejection.RECORD, key, f"the record was removed ({how})")
        self._tamper(target, revision, stored_time, f"removed ({how})")
        return Applied.REJECTED

    def _tamper(self, key: tuple[str, str], revision: int, stored_time: float, why: str) -> None:
        old = self._views.get(key)
        if old is not None and old.record is not None and old.record.revision >= revision:
            return
        record = RecordView(
            phase=None,
            writer="",
            revision=revision,
            at=stored_time,
            stored=stored_time,
            tampered=why,
        )
        if old is None:
            old = DroneView(site=sys.intern(key[0]), drone=key[1])
        self._views[key] = msgspec.structs.replace(old, record=record)

    # ------------------------------------------------------------------ liveness

    def mark_lost(self, now: float) -> list[DroneView]:
        """
        Mark every drone without a sign of life for :attr:`lost_after_s` as lost

        :param now: the current time, epoch seconds
        :returns: the views of the drones that became lost with this call
        """
        newly: list[DroneView] = []
        limit = self.lost_after_s
        for key, view in list(self._views.items()):
            lost = view.is_lost(now, limit)
            if lost != view.lost:
                updated = msgspec.structs.replace(view, lost=lost)
                self._views[key] = updated
                if lost:
                    newly.append(updated)
                    log.warning(
                        "drone %s/%s lost: no sign of life for %.0fs",
                        view.site,
                        view.drone,
                        now - (view.last_seen or now),
                        extra={"drone": view.drone, "site": view.site},
                    )
        return newly
