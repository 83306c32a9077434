"""
The handshake records in the registry: :class:`RecordMerge`, a mixin of the Registry

Its rule: records merge by KV revision, and a removed, relayed or invalid value makes
the drone's record *tampered*, never forgotten, since its drone may be up. A record's times
are the manager's (:func:`drain_due`): a writer's clock is never read.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import msgspec

from broker.manager.lifecycle import EndTracker
from broker.manager.validity import Rejection
from broker.manager.views import Applied, DroneView, RecordView
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import DroneRecord, decode_record
from remote_agent.protocol.names import is_token
from remote_agent.protocol.proof import proven


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


class RecordMerge:
    """The record methods of :class:`~broker.manager.registry.Registry`"""

    _views: dict[tuple[str, str], DroneView]
    _ends: EndTracker
    max_message_bytes: int
    proof_key: bytes | None
    records_applied: int
    records_ignored: int

    if TYPE_CHECKING:  # the Registry's own

        def reject(self, reason: Rejection, subject: str, error: object) -> Applied: ...

        def _put(self, key: tuple[str, str], old: DroneView | None, new: DroneView) -> None: ...

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
