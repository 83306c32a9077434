"""
The drone registry: the manager's latest knowledge of every drone (pure state, no I/O)

Its rule: a drone's state is its valid event (:mod:`broker.manager.validity`) that the
event stream stored last, and its valid heartbeat stored last, ordered by stream
sequence, which no drone can forge; so lost, repeated, reordered and replayed
deliveries converge to the same state, and a rebuilt registry equals the lost one.
Handshake records merge by KV revision, and a removed, relayed or invalid value makes the
drone's record *tampered*, never forgotten, since its drone may be up; a record's times are
the manager's (:func:`drain_due`), a writer's clock is never read. Times are epoch seconds
from the caller (when the stream stored each message). The consumer's events
are applied within each drone's budget (:mod:`broker.manager.budget`): beyond it the newest
is held and applied when the budget allows. Readers on other threads use
:meth:`Registry.view` and :meth:`Registry.views` (``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Final

import msgspec

from broker.errors import Rejected
from broker.manager.budget import (
    EVENT_BUDGET,
    Accounts,
    Beat,
    Budget,
    Held,
    newest_beat,
    over_budget,
)
from broker.manager.lifecycle import (
    DEFAULT_RETAIN_ENDED_S,
    DEFAULT_RETAIN_LOST_S,
    EndTracker,
    check_retain_lost,
)
from broker.manager.tardis_notes import check_note, noted_view
from broker.manager.validity import (
    UNSTORED,
    Headers,
    Rejection,
    check_event,
)
from broker.manager.views import (
    DEFAULT_CLOCK_SKEW_WARN_S,
    Applied,
    DroneView,
    Metrics,
    RecordView,
)
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import (
    EVENT_KINDS,
    AnyEvent,
    DroneRecord,
    Heartbeat,
    TardisState,
    decode_event,
    decode_record,
    encode,
)
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import Namespace, is_token
from remote_agent.protocol.proof import proven
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.registry")
_rejections = RateLimitedLog(log)

#: default time without any event after which a drone counts as lost: three
#: heartbeats of the agent's default 30 s interval
DEFAULT_LOST_AFTER_S: Final = 90.0

#: names importers of this module use, beside its own
__all__ = ["DEFAULT_LOST_AFTER_S", "Applied", "Registry"]


def drain_due(
    record: DroneRecord, is_proven: bool, at: float, old: RecordView | None
) -> float | None:
    """
    When the drain ``record`` holds is due by the manager's reckoning, epoch seconds

    - the same intent as the record it replaces: when that one was due (a drain keeps the
      time the manager first learned of it);
    - an intent of the manager's own (its proven record): its deadline, the manager's clock;
    - an intent written by an agent: the intent's duration from ``at``, when the manager
      learned of it, and never sooner than the drain known before.

    So no drone's clock, and no record a drone writes, brings a deadline forward. A rebuild
    knows only the newest revision: a drain whose record an agent rewrote (its
    ``deadline_expired``) is then due its duration after that rewrite, later, never sooner.

    :param at: when the manager learned of ``record`` (:attr:`RecordView.at`)
    :param old: the record it replaces, if known
    """
    intent = record.drain
    if intent is None:
        return None
    known = old.drain_due if old is not None and old.drain is not None else None
    if known is not None and old is not None and old.drain == intent:
        return known
    if is_proven and record.writer == "manager":
        return intent.deadline.timestamp()
    due = at + intent.duration_s
    return due if known is None else max(due, known)


class Registry:
    """
    Latest state per drone, fed with events and handshake records

    :param namespace: subjects the events must arrive on
    :param lost_after_s: seconds without any sign of life after which
        :meth:`mark_lost` marks a drone lost
    :param max_message_bytes: larger messages are rejected unread
    :param retain_ended_s: seconds an ended drone is kept before
        :meth:`due_retirements` offers it for retirement
    :param retain_lost_s: seconds after the newest fact about a drone that has not ended
        (lost, or never heard from) before :meth:`due_retirements` offers it; ``0``:
        never; else at least ``lost_after_s``
        (:func:`~broker.manager.lifecycle.least_retain_lost_s`)
    :param clock_skew_warn_s: an agent whose clock is off the server's by more is counted
        (:attr:`Metrics.clock_skewed`, :meth:`DroneView.clock_skewed`) and, with
        ``warn_clocks``, warned about in the log
    :param warn_clocks: log a line when a drone's clock goes off (the manager does; a tool
        that shows the offset itself, such as ``status``, does not)
    :param budget: each drone's budget of applied events (:mod:`broker.manager.budget`)
    :raises ValueError: for a duration that is not a positive number, or a
        ``retain_lost_s`` the retention rule refuses
    """

    def __init__(
        self,
        namespace: Namespace | None = None,
        *,
        lost_after_s: float = DEFAULT_LOST_AFTER_S,
        max_message_bytes: int = DEFAULT_MAX_SIZE,
        retain_ended_s: float = DEFAULT_RETAIN_ENDED_S,
        retain_lost_s: float = DEFAULT_RETAIN_LOST_S,
        clock_skew_warn_s: float = DEFAULT_CLOCK_SKEW_WARN_S,
        warn_clocks: bool = True,
        budget: Budget = EVENT_BUDGET,
    ) -> None:
        for name, value in (
            ("lost_after_s", lost_after_s),
            ("retain_ended_s", retain_ended_s),
            ("clock_skew_warn_s", clock_skew_warn_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, not {value!r}")
        check_retain_lost(retain_lost_s, lost_after_s)
        self.namespace = namespace or Namespace()
        self.lost_after_s = lost_after_s
        self.clock_skew_warn_s = clock_skew_warn_s
        self.warn_clocks = warn_clocks
        self.max_message_bytes = max_message_bytes
        #: drones whose newest heartbeat shows a clock off by more than ``clock_skew_warn_s``
        self._skewed: set[tuple[str, str]] = set()
        #: one line a minute for the fleet, however many clocks go off at once
        self._clocks = RateLimitedLog(log, interval_s=60.0)
        self._views: dict[tuple[str, str], DroneView] = {}
        self._ends = EndTracker(self._views, lost_after_s, retain_ended_s, retain_lost_s)
        #: every drone's account of applied events, and the events held beyond it
        self.accounts = Accounts(budget)
        self._prefix = self.namespace.prefix
        self.applied = 0
        self.duplicate = 0
        self.stale = 0
        self.rejected: dict[str, int] = dict.fromkeys(Rejection, 0)
        self.records_applied = 0
        self.records_ignored = 0
        #: the manager's record proof key; records prove the manager's phases with it
        self.proof_key: bytes | None = None
        #: called with every new view of a drone, in the thread that applies messages;
        #: a watcher must be quick and must not raise
        self.watchers: list[Callable[[DroneView], None]] = []

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
            lost=sum(view.lost and not view.ended for view in views.values()),
            ended=sum(bool(view.ended) for view in views.values()),
            coalesced=self.accounts.coalesced,
            clock_skewed=len(self._skewed),
        )

    def noisy(self, now: float) -> Mapping[tuple[str, str], float]:
        """
        The drones over their budget of events in the minute before ``now`` (epoch seconds)

        :returns: the bus time of each one's newest event beyond it, by ``(site, drone)``
        """
        return self.accounts.noisy(now)

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
        *,
        now: float | None = None,
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
        :param now: the caller's clock (any, the same it gives :meth:`release_held`):
            an event beyond its drone's budget is then held (:attr:`Applied.HELD`) until
            :meth:`release_held` applies it. ``None`` (the rebuild, tools): applied at once
        """
        try:
            event = check_event(data, subject, self._prefix, self.max_message_bytes, headers)
        except Rejected as err:
            return self.reject(err.reason, subject, err.detail)
        return self._apply(event, data, received_time, stream_seq, now)

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
        self,
        event: AnyEvent,
        data: bytes,
        received_time: float,
        stream_seq: int | None,
        now: float | None = None,
    ) -> Applied:
        """
        Apply the valid ``event`` decoded from ``data``, which the view keeps

        :param now: hold it if it is beyond its drone's budget (see :meth:`apply_message`)
        """
        key = (event.site, event.drone)
        old = self._views.get(key)
        heartbeat = isinstance(event, Heartbeat)
        if old is not None:
            known = old.stream_seq
            if stream_seq is None:
                stream_seq = max(known or 0, old.heartbeat_stream_seq or 0) + 1
            if known is not None and stream_seq <= known:
                if heartbeat:
                    # the newest heartbeat is a fact of its own, whatever order it came in
                    self._beat(key, old, _beat(event, stream_seq, received_time))
                if stream_seq == known:
                    self.duplicate += 1
                    return Applied.DUPLICATE
                self.stale += 1
                return Applied.STALE
        elif stream_seq is None:
            stream_seq = 1
        # None, usually; else the heartbeat facts of the held event this one supersedes
        superseded = (
            None
            if self.accounts.admit(key, received_time)
            else self._charge(key, event, data, received_time, stream_seq, now, heartbeat)
        )
        if isinstance(superseded, Applied):
            return superseded  # held, or older than the event held
        if old is not None:
            # the strings of the old view serve on: the event's copies are freed with it
            site, drone, record = old.site, old.drone, old.record
            tardis: tuple[int | None, str, float | None] = (None, "", None)
            ended: tuple[str, float | None] = ("", None)
            if old.tardis_seq is not None and old.tardis_seq > stream_seq:
                # TARDIS's note stays the newest word, and so does the end it made
                tardis = (old.tardis_seq, old.tardis_state, old.tardis_time)
                ended = (old.ended, old.ended_time)
            beat_seq, beat_stream, beat_time, beat_interval, beat_at = (
                old.heartbeat_seq,
                old.heartbeat_stream_seq,
                old.heartbeat_time,
                old.heartbeat_interval_s,
                old.heartbeat_at,
            )
        else:
            site = sys.intern(event.site)  # a site name repeats for thousands of drones
            drone = event.drone
            key = (site, drone)
            record = None
            tardis = (None, "", None)
            ended = ("", None)
            beat_seq = beat_stream = beat_time = beat_interval = beat_at = None
        if heartbeat:
            beat_seq, beat_stream, beat_time = event.seq, stream_seq, received_time
            beat_interval = event.interval_s  # type: ignore[union-attr]
            beat_at = event.at.timestamp()
        new = DroneView(
            site=site,
            drone=drone,
            encoded=data,
            seq=event.seq,
            kind=EVENT_KINDS[type(event)],
            state=event.snapshot.state,
            stream_seq=stream_seq,
            received_time=received_time,
            heartbeat_seq=beat_seq,
            heartbeat_stream_seq=beat_stream,
            heartbeat_time=beat_time,
            heartbeat_interval_s=beat_interval,
            heartbeat_at=beat_at,
            record=record,
            tardis_seq=tardis[0],
            tardis_state=tardis[1],
            tardis_time=tardis[2],
            ended=ended[0],
            ended_time=ended[1],
        )
        self._put(key, old, new)
        self.applied += 1
        if superseded is not None:
            self._beat(key, self._views[key], superseded)  # it may be the newest
        return Applied.APPLIED

    def _charge(
        self,
        key: tuple[str, str],
        event: AnyEvent,
        data: bytes,
        received_time: float,
        stream_seq: int,
        now: float | None,
        heartbeat: bool,
    ) -> Applied | Beat | None:
        """
        An event newer than its drone's view that the budget did not admit at once

        Its drone holds an event, or the event is beyond the budget.

        :returns: what became of it if it is not to be applied now (older than or the
            same as the event held for its drone, or held itself), else the heartbeat
            facts the held event it supersedes carries (or ``None``)
        """
        accounts = self.accounts
        beat = _beat(event, stream_seq, received_time) if heartbeat else None
        held = accounts.holding(key)
        if held is None:  # beyond the budget
            if now is None:
                return None  # the rebuild applies every event; the drone is marked noisy
            over_budget(event.site, event.drone, accounts.budget, "events")
        elif stream_seq <= held.stream_seq:
            # older than the event held for its drone, which is applied soon
            if stream_seq == held.stream_seq:
                self.duplicate += 1
                return Applied.DUPLICATE
            if beat is not None:
                accounts.beat(key, beat)
            self.stale += 1
            return Applied.STALE
        elif accounts.charge(key, received_time) or now is None:
            superseded = accounts.take(key)
            return superseded.beat if superseded is not None else None
        else:
            beat = newest_beat(held.beat, beat)
        accounts.hold(key, Held(data, received_time, stream_seq, beat), now)
        return Applied.HELD

    def _beat(self, key: tuple[str, str], old: DroneView, beat: Beat) -> None:
        """Keep ``beat`` as the drone's newest heartbeat if it is newer than the one known"""
        if old.heartbeat_stream_seq is not None and beat.stream_seq <= old.heartbeat_stream_seq:
            return
        self._views[key] = new = msgspec.structs.replace(
            old,
            heartbeat_seq=beat.seq,
            heartbeat_stream_seq=beat.stream_seq,
            heartbeat_time=beat.received_time,
            heartbeat_interval_s=beat.interval_s,
            heartbeat_at=beat.at,
        )
        self._ends.changed(key)
        self._clock_seen(new)

    def _clock_seen(self, view: DroneView) -> None:
        """Keep :attr:`clock_skewed` for a new heartbeat; warn when a drone's clock goes off"""
        key = view.key
        if not view.clock_skewed(self.clock_skew_warn_s):
            self._skewed.discard(key)
            return
        if key in self._skewed:
            return
        self._skewed.add(key)
        if not self.warn_clocks:
            return
        offset = view.clock_offset_s or 0.0
        self._clocks.warning(
            "clock",
            "the clock of drone %s/%s is %.0fs (%.1f h) %s the server's (or its heartbeats"
            " reach the bus that late); nothing the manager decides reads it, but check the"
            " node's time service",
            view.site,
            view.drone,
            abs(offset),
            abs(offset) / 3600,
            "ahead of" if offset > 0 else "behind",
            extra={"site": view.site, "drone": view.drone, "clock_offset_s": offset},
        )

    def release_held(self, now: float) -> float | None:
        """
        Apply the held events whose drones' budget allows them at ``now``

        :param now: the clock given to :meth:`apply_message` with them
        :returns: when the next one is due on that clock (``None``: nothing is held)
        """
        for key, held in self.accounts.due(now):
            event = decode_event(held.data, len(held.data))  # checked in full on arrival
            # charged by its release, beyond the budget still: applied as the rebuild applies
            self._apply(event, held.data, held.received_time, held.stream_seq)
            view = self._views.get(key)
            if held.beat is not None and view is not None:
                self._beat(key, view, held.beat)  # a heartbeat it superseded may be newest
        return self.accounts.next_release

    @property
    def next_release(self) -> float | None:
        """When :meth:`release_held` has the next held event to apply (its caller's clock)"""
        return self.accounts.next_release

    def _put(self, key: tuple[str, str], old: DroneView | None, new: DroneView) -> None:
        """Replace the view of ``key``: the end of its life is derived again next tick"""
        self._views[key] = new
        self._ends.changed(key)
        self._ends.noted(old, new)
        if new.heartbeat_stream_seq != (old.heartbeat_stream_seq if old is not None else None):
            self._clock_seen(new)
        self._tell(new)

    def _tell(self, view: DroneView) -> None:
        for watcher in self.watchers:
            watcher(view)

    # ------------------------------------------------------------------ notes

    def apply_note_message(
        self,
        data: bytes,
        subject: str,
        stored_time: float,
        stream_seq: int | None = None,
        headers: Headers = UNSTORED,
    ) -> Applied:
        """
        Check and apply one TARDIS state note (:mod:`broker.manager.tardis_notes`)

        Only the newest note that no agent event follows in the stream counts; a
        note of a drone nothing is known about counts only if it says TARDIS gave
        the drone up (then its end is known). Never raises for bad input.
        """
        try:
            note = check_note(data, subject, self._prefix, self.max_message_bytes, headers)
        except Rejected as err:
            return self.reject(err.reason, subject, err.detail)
        return self._apply_note(note, stored_time, stream_seq)

    def _apply_note(self, note: TardisState, stored_time: float, stream_seq: int | None) -> Applied:
        key = (note.site, note.drone)
        old = self._views.get(key)
        new = noted_view(old, note, stored_time, stream_seq)
        if new is None:
            return Applied.STALE
        self._put(key, old, new)
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
        self,
        record: DroneRecord,
        revision: int,
        stored_time: float | None,
        now: float | None = None,
    ) -> Applied:
        """
        Merge a decoded handshake record at ``revision`` (the KV revision)

        :param stored_time: when the bucket stored it (from the KV watch), or
            ``None`` for a record the manager just read or wrote itself
        :param now: the manager's clock, for a record without ``stored_time``
            (default: read it now)
        """
        key = (record.site, record.drone)
        old = self._views.get(key)
        if old is not None and old.record is not None and old.record.revision >= revision:
            if old.record.revision == revision and old.record.stored is None and stored_time:
                confirmed = msgspec.structs.replace(old.record, stored=stored_time)
                self._views[key] = msgspec.structs.replace(old, record=confirmed)
                self._ends.changed(key)
            self.records_ignored += 1
            return Applied.DUPLICATE if old.record.revision == revision else Applied.STALE
        at = stored_time if stored_time is not None else (time.time() if now is None else now)
        is_proven = proven(self.proof_key, record)
        new_record = RecordView(
            phase=record.phase,
            writer=record.writer,
            revision=revision,
            incarnation=record.incarnation,
            drain=record.drain,
            at=at,
            stored=stored_time,
            drain_due=drain_due(record, is_proven, at, old.record if old else None),
            note=record.note,
            proven=is_proven,
        )
        new = msgspec.structs.replace(
            old or DroneView(site=sys.intern(record.site), drone=record.drone), record=new_record
        )
        self._put(key, old, new)
        self.records_applied += 1
        return Applied.APPLIED

    def record_relayed(self, key: str, revision: int, stored_time: float, why: str) -> Applied:
        """
        A value on ``key`` that no writer of records published (a server's answer
        relayed there, :func:`broker.manager.validity.relayed`): the record is tampered

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
        new = msgspec.structs.replace(
            old or DroneView(site=sys.intern(key[0]), drone=key[1]), record=record
        )
        self._put(key, old, new)

    # ------------------------------------------------------------------ liveness

    def mark_ended(self, now: float) -> list[DroneView]:
        """
        Derive the end of every drone whose view changed or whose silence is due
        (:func:`broker.manager.lifecycle.ended_by`); run it before :meth:`mark_lost`

        :returns: the views of the drones that ended with this call
        """
        newly = self._ends.mark_ended(now)
        for view in newly:
            self._tell(view)
        return newly

    @property
    def pending_ends(self) -> int:
        """Drones whose end the next :meth:`mark_ended` derives again (beside silent ones)"""
        return self._ends.pending

    def due_retirements(self, now: float, limit: int = 1000) -> list[DroneView]:
        """
        Up to ``limit`` drones to retire: ended ones kept for ``retain_ended_s``, and
        those not ended that nothing came of for ``retain_lost_s``
        """
        return self._ends.due(now, limit)

    def retirable(self, view: DroneView) -> bool:
        """
        Whether ``view`` is still the drone's view, and ended or offered for its silence
        (what :meth:`retire` drops)
        """
        return (
            self._views.get(view.key) is view
            and self.accounts.holding(view.key) is None  # it spoke: its event is held
            and (bool(view.ended) or self._ends.forgotten(view))
        )

    def retire(self, view: DroneView) -> bool:
        """
        Drop ``view`` from the registry if it is :meth:`retirable`

        :returns: whether it was dropped (not if the drone spoke or changed since)
        """
        if not self.retirable(view):
            return False
        del self._views[view.key]
        self._skewed.discard(view.key)
        self._ends.dropped(view)
        self.accounts.dropped(view.key)
        return True

    def retry_retirement(self, view: DroneView, at: float) -> None:
        """Offer ``view`` for retirement again at ``at``"""
        self._ends.later(view, at)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """
        While a rebuild replays the stream and the bucket: no operator lines about drones
        (announced, first payload, ended, ...); the manager before the restart told them
        """
        self._ends.quiet = True
        try:
            yield
        finally:
            self._ends.quiet = False

    def rescan(self) -> None:
        """Derive every drone's end on the next :meth:`mark_ended` (after a rebuild)"""
        self._ends.rescan(self._views.keys())

    def mark_lost(self, now: float) -> list[DroneView]:
        """
        Mark every drone without a sign of life for :attr:`lost_after_s` as lost;
        an ended drone is never lost

        :param now: the current time, epoch seconds
        :returns: the views of the drones that became lost with this call
        """
        newly = self._ends.mark_lost(now)
        for view in newly:
            self._tell(view)
        return newly


def _beat(event: AnyEvent, stream_seq: int, received_time: float) -> Beat:
    """The heartbeat facts of ``event``, a heartbeat"""
    interval_s: float = event.interval_s  # type: ignore[union-attr]
    return Beat(event.seq, stream_seq, received_time, interval_s, event.at.timestamp())
