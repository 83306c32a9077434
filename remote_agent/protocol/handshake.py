"""
The release handshake: the phases of each drone's record and compare-and-set access to it

Of "agent: I am up" and "manager: released, it never came up" exactly one wins; both
sides write the bucket only through :class:`RecordStore` (``docs/handshake.md``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from remote_agent.protocol.connect import bind_bucket
from remote_agent.protocol.errors import HandshakeError, RecordTampered, SchemaError
from remote_agent.protocol.events import (
    DrainIntent,
    DroneRecord,
    RecordPhase,
    decode_record,
    encode,
    utcnow,
)
from remote_agent.protocol.names import EXPECTED_LAST, Namespace, kv_write_prefix
from remote_agent.protocol.proof import proven, record_proof
from remote_agent.protocol.ratelog import RateLimitedLog
from remote_agent.protocol.transient import TRANSIENT_BUDGET_S, Backoff, is_transient, patiently

log = logging.getLogger("remote_agent.handshake")

Writer = Literal["agent", "manager"]
_Decide = Callable[["Versioned | None"], DroneRecord | None]

#: JetStream's error codes for "the subject's last sequence is not the expected one"
_WRONG_LAST_SEQUENCE = frozenset({10071, 10164})


# --------------------------------------------------------------------------- phases
#
# The phases of a drone's record and the transitions cooperating clients keep to. A drone
# can still write any value to its own key; :func:`allowed` is what RecordStore refuses
# to write:
#
#     (absent) --agent claim--> UP --drain--> DRAINING --agent--> DRAINED
#     (absent) --manager release--> RELEASED          \--agent--> DEADLINE_EXPIRED
#     UP --agent claim (new incarnation)--> UP
#     UP --agent, idle release--> DRAINED

#: phases in which no payload may start and nothing will ever open the gate again
CLOSED_PHASES: Final = frozenset(
    {RecordPhase.RELEASED, RecordPhase.DRAINING, RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED}
)

_TRANSITIONS = {
    RecordPhase.UP: {
        RecordPhase.UP,
        RecordPhase.DRAINING,
        RecordPhase.DRAINED,
        RecordPhase.DEADLINE_EXPIRED,
    },
    RecordPhase.DRAINING: {RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED},
    RecordPhase.DEADLINE_EXPIRED: {RecordPhase.DRAINED},
    RecordPhase.RELEASED: set(),
    RecordPhase.DRAINED: set(),
}

#: phases nothing follows: a record in one of them stays as it is
FINAL_PHASES: Final = frozenset(phase for phase, following in _TRANSITIONS.items() if not following)


def allowed(old: RecordPhase, new: RecordPhase) -> bool:
    """Whether a cooperating client may write ``new`` over a record in ``old``"""
    return new in _TRANSITIONS[old]


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Versioned:
    """A record as stored, with the revision a compare-and-set must name"""

    record: DroneRecord
    revision: int


class RecordStore:
    """
    Compare-and-set access to the handshake bucket

    :param attempts: how often a conflicting write is retried after re-reading the
        record; a conflict means someone else wrote in between, which the loop then
        takes into account
    :param transient_s: how long a read or a write is retried while it fails
        transiently (:mod:`remote_agent.protocol.transient`: the server is away, the
        bucket has no leader for a moment), in seconds
    :param logger: where its lines go (the manager passes one of its own tree)
    """

    def __init__(
        self,
        kv: KeyValue,
        namespace: Namespace,
        attempts: int = 20,
        *,
        js: JetStreamContext,
        domain: str | None = None,
        proof_key: bytes | None = None,
        transient_s: float = TRANSIENT_BUDGET_S,
        logger: logging.Logger = log,
    ) -> None:
        self.kv = kv
        self.log = logger
        self.namespace = namespace
        self.attempts = attempts
        self.transient_s = transient_s
        self._failures = RateLimitedLog(logger)
        self.domain = domain
        #: the manager's proof key (:func:`load_proof_key`); ``None`` on the drone
        self.proof_key = proof_key
        self._js = js
        bucket = namespace.record_bucket
        self._write_prefix = kv_write_prefix(bucket, domain)

    @property
    def write_prefix(self) -> str:
        """Where writes of a key go: ``$KV.<bucket>.``, across a domain through its API"""
        return self._write_prefix

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        namespace: Namespace,
        domain: str | None = None,
        *,
        proof_key: bytes | None = None,
        logger: logging.Logger = log,
    ) -> RecordStore:
        """
        Bind to the (provisioned) bucket of ``namespace``

        :param js: a context for ``domain`` (``nc.jetstream(domain=domain)``)
        :param domain: the JetStream domain of the bucket, if it is not the local one
        :param proof_key: the manager's proof key; needed to release and to tell
            the manager's records from forgeries
        :param logger: where its lines go
        """
        kv = await bind_bucket(js, namespace.record_bucket, "handshake")
        return cls(kv, namespace, js=js, domain=domain, proof_key=proof_key, logger=logger)

    def key(self, site: str, drone: str) -> str:
        return self.namespace.record_key(site, drone)

    async def read(self, site: str, drone: str) -> Versioned | None:
        """
        The current record, or ``None`` if the drone has none

        :raises HandshakeError: if the stored value is not a valid record
        """
        try:
            entry = await self._get(self.key(site, drone))
        except nats.js.errors.KeyNotFoundError:  # also deleted or purged
            return None
        try:
            record = decode_record(entry.value or b"")
            if (record.site, record.drone) != (site, drone):
                raise SchemaError(f"the record of {record.site}/{record.drone}")
        except SchemaError as err:
            raise RecordTampered(f"stored record of {site}/{drone} is invalid: {err}") from err
        assert entry.revision is not None
        return Versioned(record, entry.revision)

    async def removed(self, site: str, drone: str) -> bool:
        """Whether the key's newest revision is a delete or purge marker (someone removed it)"""
        try:
            await self._get(self.key(site, drone))
        except nats.js.errors.KeyNotFoundError as gone:
            return gone.entry is not None
        return False

    async def _get(self, key: str) -> KeyValue.Entry:
        """
        The key's newest value, read again while reading fails transiently

        :raises KeyNotFoundError: if it has none (``entry`` set: a delete or purge marker)
        """
        return await patiently(
            lambda: self.kv.get(key),
            self.transient_s,
            lambda err: self._transient("read", key, err),
        )

    def _transient(self, what: str, key: str, err: BaseException) -> None:
        self._failures.warning(
            f"{what} failed", "%s of %s failed, trying again: %r", what, key, err
        )

    def proven(self, record: DroneRecord) -> bool:
        """Whether ``record`` carries the manager's proof (see :func:`proven`)"""
        return proven(self.proof_key, record)

    def _signed(self, record: DroneRecord) -> DroneRecord:
        """``record`` with the manager's proof; without a proof key, as it is
        (the agent acts on it all the same, the manager does not take it for its own)"""
        if self.proof_key is None:
            return record
        return msgspec.structs.replace(record, proof=record_proof(self.proof_key, record))

    async def _write(
        self, record: DroneRecord, revision: int | None, *, over_marker: bool = True
    ) -> Versioned | None:
        """
        Create (``revision is None``) or compare-and-set; ``None`` if someone else won

        A create writes over a delete or purge marker only if ``over_marker``. A write
        that failed transiently may still have been stored: the record is then re-read
        and compared, so a retry never applies a change twice; while the key is still as
        it was, the same write is tried again, for :attr:`transient_s`.

        :raises: the last transient error once :attr:`transient_s` has passed
        """
        key = self.key(record.site, record.drone)
        value = encode(record)
        deadline = time.monotonic() + self.transient_s
        backoff = Backoff(first=0.05, most=1.0)
        while True:
            try:
                if revision is None:
                    new = await self._publish(key, value, 0)
                    if new is None and over_marker:
                        new = await self._recreate(key, value)
                else:
                    new = await self._publish(key, value, revision)
                return Versioned(record, new) if new is not None else None
            except Exception as err:
                if not is_transient(err) or time.monotonic() >= deadline:
                    raise
                self._transient("write", key, err)
            current = await self.read(record.site, record.drone)
            if current is not None and current.record == record:
                return current  # stored before the failure was seen
            known = None if current is None else current.revision
            if known != revision:
                return None  # someone else wrote meanwhile: decide again
            await asyncio.sleep(min(backoff.delay(), max(0.0, deadline - time.monotonic())))

    async def _publish(self, key: str, value: bytes, last: int) -> int | None:
        """Store ``value`` if the key's newest revision is ``last`` (0: none); its revision"""
        headers = {EXPECTED_LAST: str(last)}
        try:
            ack = await self._js.publish(self._write_prefix + key, value, headers=headers)
        except nats.js.errors.APIError as err:
            if err.err_code in _WRONG_LAST_SEQUENCE:
                return None
            raise
        return ack.seq

    async def _recreate(self, key: str, value: bytes) -> int | None:
        """
        A create that found the key taken: write over a delete or purge marker

        A deleted or purged key keeps its marker as its newest revision, so
        create-if-absent fails on it; like ``KeyValue.create`` this writes
        over the marker. A live value means someone else created it: ``None``.
        """
        try:
            await self._get(key)
        except nats.js.errors.KeyNotFoundError as gone:
            if gone.entry is None:
                return None
            return await self._publish(key, value, gone.entry.revision)
        return None

    async def _transition(
        self,
        site: str,
        drone: str,
        decide: _Decide,
    ) -> Versioned:
        """
        Read, let ``decide`` choose the next record, compare-and-set; repeat on conflict

        ``decide(current)`` returns the record to write, or ``None`` to keep
        ``current`` as it is (the operation is then already done or refused).
        """
        backoff = Backoff(first=0.005, most=0.05)
        for attempt in range(self.attempts):
            current = await self.read(site, drone)
            wanted = decide(current)
            if wanted is None:
                if current is None:
                    raise HandshakeError(f"no record for {site}/{drone} and nothing to write")
                return current
            if current is not None and not allowed(current.record.phase, wanted.phase):
                raise HandshakeError(
                    f"refusing {current.record.phase} -> {wanted.phase} for {site}/{drone}"
                )
            written = await self._write(wanted, None if current is None else current.revision)
            if written is not None:
                return written
            self.log.debug("lost a compare-and-set on %s/%s (attempt %d)", site, drone, attempt + 1)
            await asyncio.sleep(backoff.delay())
        raise HandshakeError(f"gave up on {site}/{drone} after {self.attempts} conflicting writes")

    # ----------------------------------------------------------------- agent side

    async def claim(self, site: str, drone: str, incarnation: str) -> Versioned:
        """
        The agent announces itself before it lets any payload start

        :returns: the record in effect. The agent may open its gate only if it
            is ``UP`` with the agent's ``incarnation``; ``RELEASED`` means the
            manager won and no payload may ever start; ``DRAINING`` and later
            phases keep the gate shut.
        """

        def decide(current: Versioned | None) -> DroneRecord | None:
            if current is None or current.record.phase is RecordPhase.UP:
                if current is not None and current.record.incarnation == incarnation:
                    return None
                return DroneRecord(
                    site=site,
                    drone=drone,
                    phase=RecordPhase.UP,
                    writer="agent",
                    incarnation=incarnation,
                    at=utcnow(),
                )
            return None

        result = await self._transition(site, drone, decide)
        self.log.info(
            "claim of %s/%s: %s", site, drone, result.record.phase, extra={"drone": drone}
        )
        return result

    async def finish(
        self,
        site: str,
        drone: str,
        incarnation: str,
        phase: Literal[RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED],
        note: str = "",
    ) -> Versioned:
        """
        The agent records that it is drained (idle, gate shut) or that its deadline passed

        Keeps the drain intent. A released or drained record, or one already in
        ``phase``, is left alone; ``DEADLINE_EXPIRED`` may still become ``DRAINED``
        once the last payload has ended.
        """

        def decide(current: Versioned | None) -> DroneRecord | None:
            if current is not None and (
                current.record.phase in FINAL_PHASES or current.record.phase == phase
            ):
                return None
            return DroneRecord(
                site=site,
                drone=drone,
                phase=phase,
                writer="agent",
                incarnation=incarnation,
                drain=current.record.drain if current is not None else None,
                at=utcnow(),
                note=note,
            )

        return await self._transition(site, drone, decide)

    # --------------------------------------------------------------- manager side

    async def release(self, site: str, drone: str, note: str = "") -> Versioned:
        """
        The manager releases a drone that has not announced itself

        Only a key that was never written can be released: a key whose record
        was deleted or purged held a record once, so its agent may be up.

        :returns: ``RELEASED`` with the manager's proof if it won (no payload can
            ever start; the batch job may be removed), otherwise the record in
            the bucket, which means the agent won and the drone must be drained
            instead (a ``released`` record without proof is no release: check
            :meth:`proven`)
        :raises RecordTampered: if the record was removed or is invalid
        """
        record = self._signed(
            DroneRecord(
                site=site,
                drone=drone,
                phase=RecordPhase.RELEASED,
                writer="manager",
                at=utcnow(),
                note=note,
            )
        )
        written = await self._write(record, None, over_marker=False)
        if written is not None:
            self.log.info("released %s/%s before its agent came up", site, drone)
            return written
        current = await self.read(site, drone)
        if current is None:
            raise RecordTampered(f"the record of {site}/{drone} was removed: not releasing it")
        return current

    async def request_drain(
        self, site: str, drone: str, intent: DrainIntent, writer: Writer = "manager"
    ) -> Versioned:
        """
        Record the intent to drain by ``intent.deadline``

        Only an ``UP`` record becomes ``DRAINING``; an existing drain, a
        release or a final phase is returned unchanged (idempotent). A drone
        without record gets none: release it instead.
        """

        def decide(current: Versioned | None) -> DroneRecord | None:
            if current is None:
                raise HandshakeError(f"{site}/{drone} has not announced itself: release it")
            if current.record.phase is not RecordPhase.UP:
                return None
            record = DroneRecord(
                site=site,
                drone=drone,
                phase=RecordPhase.DRAINING,
                writer=writer,
                incarnation=current.record.incarnation,
                drain=intent,
                at=utcnow(),
            )
            return self._signed(record) if writer == "manager" else record

        return await self._transition(site, drone, decide)
