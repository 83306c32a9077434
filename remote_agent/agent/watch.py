"""
The claim and the watch of the handshake record

The gate opens only after this incarnation claimed its record; while the agent
is up, every hint, reconnect and heartbeat re-reads the record, and a record
that no longer says "up" for this agent shuts the gate at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections import Counter

import msgspec
import nats.errors

from remote_agent.agent.bounds import bounded_intent
from remote_agent.agent.drain import Drain
from remote_agent.agent.emission import Emitter
from remote_agent.agent.record import RecordClient
from remote_agent.agent.status import DroneStatus
from remote_agent.agent.tasks import Tasks
from remote_agent.agent.worker import Worker
from remote_agent.protocol.backoff import Backoff
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.events import (
    DrainIntent,
    DroneRecord,
    DroneState,
    GateClosed,
    GateOpened,
    RecordPhase,
    Released,
    utcnow,
)
from remote_agent.protocol.phases import CLOSED_PHASES
from remote_agent.settings import Settings

log = logging.getLogger("remote_agent.agent")

#: reads again after a hint found the record unchanged: a hint comes as a write is
#: published, and the stream may store the write a moment later
_SETTLE_READS = 6

S = DroneState


class RecordWatch:
    """
    Claims the record before the gate may open, then acts on what it says

    :param claimable: set once the claim may start (the startd is ready)
    :param listening: set once the command and record-hint subscriptions are in
    """

    def __init__(
        self,
        settings: Settings,
        incarnation: str,
        status: DroneStatus,
        emitter: Emitter,
        record: RecordClient,
        drain: Drain,
        worker: Worker,
        tasks: Tasks,
        counters: Counter[str],
        *,
        claimable: asyncio.Event,
        listening: asyncio.Event,
    ) -> None:
        self._settings = settings
        self._incarnation = incarnation
        self._status = status
        self._emitter = emitter
        self._record = record
        self._drain = drain
        self._worker = worker
        self._tasks = tasks
        self._counters = counters
        self._claimable = claimable
        self._listening = listening
        self._site = settings.site
        self._drone = settings.drone
        self._recheck = asyncio.Event()
        #: the record's revision as last read (``None`` before the claim)
        self._revision: int | None = None
        #: the incarnation of the record this agent claimed (an earlier one's drain)
        self._claimed_incarnation = incarnation

    def hint(self) -> None:
        """The record may have changed: read it again"""
        self._recheck.set()

    async def claim(self) -> None:
        """Claim the record before the gate may open; act on what it says"""
        await self._claimable.wait()
        # subscribed first: every write to the record after the claim's read is a hint
        await self._listening.wait()
        backoff = Backoff(first=0.2, most=5.0)
        failures = 0
        while not self._status.sealed:
            store = await self._record.store()
            try:
                versioned = await store.claim(self._site, self._drone, self._incarnation)
            except (HandshakeError, nats.errors.Error, OSError, TimeoutError) as err:
                failures += 1
                log.log(
                    logging.WARNING if failures in (1, 10) else logging.DEBUG,
                    "cannot claim the handshake record yet (bucket %s provisioned?): %r",
                    self._record.bucket,
                    err,
                    extra={"drone": self._drone},
                )
                await asyncio.sleep(backoff.delay())
                continue
            self._revision = versioned.revision
            self._apply_claim(versioned.record)
            return

    def _apply_claim(self, record: DroneRecord) -> None:
        phase = record.phase
        status = self._status
        if phase is RecordPhase.UP and record.incarnation == self._incarnation:
            status.claimed = True
            if status.sealed:
                log.info("claimed, but the gate is shut already", extra={"drone": self._drone})
                return
            status.open_gate()
            self._emitter.emit(GateOpened, reason="handshake record claimed")
        elif phase is RecordPhase.RELEASED:
            self._on_released(record)
        elif phase in CLOSED_PHASES:  # not released (above): told to drain
            # an earlier incarnation was told to drain: carry on with that intent
            status.claimed = True
            self._claimed_incarnation = record.incarnation
            intent = record.drain or DrainIntent(
                deadline=utcnow(),
                reason=record.note or f"handshake record is {phase}",
                requested_at=record.at,
            )
            self._drain.accept(self._record_intent(intent), write_intent=False)
        else:
            log.error("unexpected claim result %s", record, extra={"drone": self._drone})

    def _on_released(self, record: DroneRecord) -> None:
        status = self._status
        if status.released:
            return
        status.released = True
        status.seal_gate()
        if status.state is not S.EXITING:
            status.move(S.RELEASED)
        reason = record.note or "released by the manager before the agent came up"
        self._emitter.emit(Released, reason=reason)
        log.warning("drone released: %s; ending the job", reason, extra={"drone": self._drone})
        self._tasks.spawn(self._worker.end_job("released"), "end-job")

    async def watch(self) -> None:
        """Re-read the record on every hint, reconnect and heartbeat, and act on it"""
        status = self._status
        settle = Backoff(first=0.05, most=1.0)
        unchanged = 0
        wait: float | None = None  # for the next hint; else until a settling re-read
        while not status.winding_down:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), wait)
            self._recheck.clear()
            wait = None
            if not status.claimed or status.released or status.record_lost is not None:
                continue
            try:
                store = await self._record.store()
                current = await store.read(self._site, self._drone)
            except HandshakeError as err:  # a value that is no valid record
                self._on_record_lost(f"the record does not decode ({err})")
                continue
            except (nats.errors.Error, OSError, TimeoutError) as err:
                log.debug("cannot read the record: %r", err, extra={"drone": self._drone})
                await asyncio.sleep(self._settings.reconnect_wait_s)
                self._recheck.set()  # the hint is not lost with the failed read
                continue
            if current is None:
                self._on_record_lost("the record was deleted")
                continue
            if current.revision == self._revision and unchanged < _SETTLE_READS:
                unchanged += 1
                wait = settle.delay()
            else:
                unchanged = 0
                settle.reset()
            self._revision = current.revision
            self._apply_record(current.record)

    def _apply_record(self, record: DroneRecord) -> None:
        """Act on the record as read while the agent is up (claimed)"""
        phase = record.phase
        if phase is RecordPhase.RELEASED:
            self._on_record_lost(f"the record says released (writer {record.writer})")
        elif record.incarnation not in (self._incarnation, self._claimed_incarnation):
            self._on_record_lost(
                f"the record says {phase} for another incarnation ({record.incarnation!r})"
            )
        elif phase is RecordPhase.DRAINING and record.drain is not None:
            if self._status.drain is None:
                log.info("the record asks for a drain", extra={"drone": self._drone})
                self._drain.accept(self._record_intent(record.drain), write_intent=False)
        elif (
            phase is not RecordPhase.UP
            and self._status.drain is None
            and self._status.state not in (S.DRAINED, S.EXITING)
        ):
            log.warning(
                "the record says %s although no drain was accepted; draining",
                phase,
                extra={"drone": self._drone},
            )
            self._drain.self_drain(f"handshake record is {phase}")

    def _on_record_lost(self, why: str) -> None:
        """
        The record no longer says that this agent is up: shut the gate at once, then drain

        Payloads keep running; the drain waits for them (until the self-drain
        deadline, ``--self-drain-deadline``) and ends the job as a drain does.
        The agent never writes the record again: it is not the agent's any more.
        """
        status = self._status
        if status.record_lost is not None:
            return
        status.record_lost = why
        self._counters["record_lost"] += 1
        was_open = status.seal_gate()
        log.warning(
            "handshake record lost while up: %s; gate closed, draining",
            why,
            extra={"drone": self._drone},
        )
        if was_open:
            self._emitter.emit(GateClosed, reason=f"record lost: {why}")
        if status.drain is None and status.state not in (S.DRAINED, S.EXITING):
            self._drain.self_drain(f"record lost: {why}")

    def _record_intent(self, intent: DrainIntent) -> DrainIntent:
        """
        A drain intent read from the record, with a deadline no sooner than a self-drain's

        The record's value may not be the manager's: the server stores on a
        record's subject what other drones make it send there (a reply subject
        is not checked against permissions), and the agent cannot check the
        manager's proof. A deadline, which ends in ``deadline_expired`` and so
        in the drone's removal, counts at once only when it comes as a command,
        which only the manager can send.
        """
        earliest = utcnow() + dt.timedelta(seconds=self._settings.self_drain_deadline_s)
        if intent.deadline >= earliest:
            return bounded_intent(intent)
        return bounded_intent(msgspec.structs.replace(intent, deadline=earliest))
