"""
The handshake records in the registry: :class:`RecordMerge`, a mixin of the Registry

Its rule: records merge by KV revision, and a removed, relayed or invalid value makes
the drone's record *tampered*, never forgotten, since its drone may be up.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import msgspec

from broker.manager.lifecycle import EndTracker
from broker.manager.validity import Rejection
from broker.manager.views import Applied, DroneView, RecordView
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import DroneRecord, decode_record
from remote_agent.protocol.names import is_token
from remote_agent.protocol.proof import proven


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
                self._ends.changed(key)
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
