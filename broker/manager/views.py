"""
What the registry knows about one drone, as immutable views, and what it counts

A :class:`DroneView` keeps the newest valid event as the bytes that came off the
stream and decodes the rest when someone reads it; :class:`Applied` says what one
message did, :class:`Metrics` counts it. Its rule: a view is replaced,
never changed, so readers on other threads see each one whole.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import msgspec

from remote_agent.protocol.events import (
    AnyEvent,
    DrainIntent,
    DroneState,
    Payload,
    RecordPhase,
    Snapshot,
    decode_event,
)

#: default seconds an agent's clock may be off the server's before it is warned about
DEFAULT_CLOCK_SKEW_WARN_S: Final = 60.0


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
    #: when the manager learned of it, epoch seconds: the bucket's time, or the manager's
    #: clock for a record it merged from its own read or write; never the writer's clock
    at: float
    #: when the bucket stored it, epoch seconds; ``None`` until the KV watch
    #: confirms a record that the manager merged from its own read or write
    stored: float | None = None
    #: when the drain in :attr:`drain` is due by the manager's reckoning, epoch seconds
    #: (:func:`broker.manager.registry.drain_due`); ``None`` without a drain
    drain_due: float | None = None
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
    #: the agent's own clock when it made that heartbeat (its ``at``), epoch seconds
    heartbeat_at: float | None = None
    record: RecordView | None = None
    #: TARDIS's newest state note about the drone, if no agent event is newer: its
    #: stream sequence, the state (a class name, e.g. ``DownState``) and when it was stored
    tardis_seq: int | None = None
    tardis_state: str = ""
    tardis_time: float | None = None
    #: set by :meth:`Registry.mark_lost`, cleared by the next event; never set once ended
    lost: bool = False
    #: why the drone's life ended (``""``: it has not), and the time of the fact that
    #: ended it (stream times, so a rebuilt registry agrees); see
    #: :mod:`broker.manager.lifecycle`
    ended: str = ""
    ended_time: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.site, self.drone)

    @property
    def event(self) -> AnyEvent | None:
        """
        The newest event, decoded anew on every access (keep the result if
        you need several of its fields)
        """
        encoded = self.encoded
        # checked in full on arrival, against the registry's size limit
        return decode_event(encoded, len(encoded)) if encoded is not None else None

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
    def clock_offset_s(self) -> float | None:
        """
        How far the agent's clock is ahead of the server's (negative: behind), seconds

        By its newest heartbeat: its ``at`` less when the stream stored it. A heartbeat
        cannot be stored before it was made, so a clock ahead shows as it is; one that
        reached the bus late (spooled through an outage) makes the clock look behind by
        its delay, at most a heartbeat interval for the newest one.
        """
        if self.heartbeat_at is None or self.heartbeat_time is None:
            return None
        return self.heartbeat_at - self.heartbeat_time

    def clock_skewed(self, warn_s: float) -> bool:
        """
        Whether the agent's clock is off the server's by more than ``warn_s`` seconds:
        ahead by more, or behind by more than that and its heartbeat interval
        """
        offset = self.clock_offset_s
        if offset is None:
            return False
        return offset > warn_s or -offset > warn_s + (self.heartbeat_interval_s or 0.0)

    def ends_in_s(self, now: float) -> float | None:
        """
        Seconds from ``now`` (the manager's clock) until the drone's batch job ends, by its
        newest snapshot's ``end``; ``None``: its agent knows of no end

        The agent's span counts from its event, the manager's clock from when the bus stored
        that event: no clock of the drone is read. Never negative.
        """
        event = self.event
        if event is None or self.received_time is None:
            return None
        return ends_in_s(event, self.received_time, now)

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

    def counts_lost(self, now: float, lost_after_s: float) -> bool:
        """Whether the drone counts as lost: silent (:meth:`is_lost`) and its life not ended"""
        return not self.ended and self.is_lost(now, lost_after_s)


def elapsed_since(then: dt.datetime, event: AnyEvent, received_time: float, now: float) -> float:
    """
    Seconds from ``then``, a time on an agent's clock, to ``now``, a time on the manager's

    The agent's clock counts from ``then`` to its ``event``, the bus's from storing that
    event (``received_time``) to ``now``: each clock only measures a span, so an agent's
    clock that is off by any amount changes nothing. Never negative.
    """
    return max(0.0, (event.at - then).total_seconds() + now - received_time)


def ends_in_s(event: AnyEvent, received_time: float, now: float) -> float | None:
    """
    Seconds from ``now``, a time on the manager's clock, until the drone's batch job ends, by
    the ``end`` of ``event``'s snapshot, which reached the bus at ``received_time``; ``None``:
    its agent knows of no end. The agent's span counts from its event, the bus's clock from
    storing it, as in :func:`elapsed_since`. Never negative.
    """
    end = event.snapshot.end
    if end is None:
        return None
    return max(0.0, end.in_s - (now - received_time))


def iso_time(epoch: float) -> str:
    """A time the views hold (epoch seconds) as people read it: ISO 8601, UTC, to the second"""
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="seconds")


class Applied(enum.StrEnum):
    """What :meth:`~broker.manager.registry.Registry.apply` did with one event"""

    APPLIED = "applied"  #: newer than anything known: the drone's state is now this event's
    DUPLICATE = "duplicate"  #: same ``seq`` as the newest known event
    STALE = "stale"  #: older ``seq`` than the newest known event
    REJECTED = "rejected"  #: invalid; see the counted reason
    #: newer than anything known, but beyond its drone's budget: held as the drone's newest
    #: event and applied when the budget allows, unless a newer one supersedes it
    HELD = "held"


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
    lost: int  #: drones lost and not ended
    ended: int = 0  #: drones whose life ended, not yet retired
    #: events held beyond their drone's budget and superseded before they were applied
    coalesced: int = 0
    clock_skewed: int = 0  #: drones whose clock is off the server's beyond the threshold

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())
