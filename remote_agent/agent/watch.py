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

import msgspec
import nats.errors

from remote_agent.agent.bounds import bounded_intent
from remote_agent.agent.context import AgentContext
from remote_agent.agent.drain import Drain
from remote_agent.agent.steering import Steering
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.events import (
    DrainIntent,
    DroneRecord,
    DroneState,
    GateClosed,
    GateOpened,
    RecordPhase,
    Released,
)
from remote_agent.protocol.handshake import CLOSED_PHASES
from remote_agent.protocol.transient import Backoff

log = logging.getLogger("remote_agent.agent")

#: reads again after a write notice found the record unchanged: the notice comes as
#: the write is published, and the stream may store it a moment later
_SETTLE_READS = 6

S = DroneState


class RecordWatch:
    """
    Claims the record before the gate may open, then acts on what it says

    :param claimable: set once the claim may start (the startd is ready)
    :param end_known: set once the drone's end was asked for: the gate judges every
        payload by it
    """

    def __init__(
        self,
        context: AgentContext,
        steering: Steering,
        drain: Drain,
        *,
        claimable: asyncio.Event,
        end_known: asyncio.Event,
    ) -> None:
        self._context = context
        self._record = steering.record
        self._worker = steering.worker
        self._drain = drain
        self._claimable = claimable
        self._end_known = end_known
        #: set once the command and record-hint subscriptions are in (by the command server)
        self.listening = asyncio.Event()
        self._recheck = asyncio.Event()
        #: the record's revision as last read (``None`` before the claim)
        self._revision: int | None = None
        #: reads left to wait for a write that a notice announced
        self._settling = 0
        #: the incarnation of the record this agent claimed (an earlier one's drain)
        self._claimed_incarnation = context.incarnation

    def hint(self) -> None:
        """A write to the record was seen: read it until it shows, a few times at most"""
        self._settling = _SETTLE_READS
        self._recheck.set()

    def recheck(self) -> None:
        """Read the record once (a heartbeat, a reconnect)"""
        self._recheck.set()

    async def claim(self) -> None:
        """Claim the record before the gate may open; act on what it says"""
        await self._claimable.wait()
        await self._end_known.wait()
        # subscribed first: every write to the record after the claim's read is a hint
        await self.listening.wait()
        context = self._context
        backoff = Backoff(first=0.2, most=5.0)
        failures = 0
        while not context.status.sealed:
            store = await self._record.store()
            try:
                versioned = await store.claim(context.site, context.drone, context.incarnation)
            except (HandshakeError, nats.errors.Error, OSError, TimeoutError) as err:
                failures += 1
                log.log(
                    logging.WARNING if failures in (1, 10) else logging.DEBUG,
                    "cannot claim the handshake record yet (bucket %s provisioned?): %r",
                    self._record.bucket,
                    err,
                    extra=context.extra,
                )
                await asyncio.sleep(backoff.delay())
                continue
            self._revision = versioned.revision
            self._apply_claim(versioned.record)
            return

    def _apply_claim(self, record: DroneRecord) -> None:
        phase = record.phase
        status = self._context.status
        if phase is RecordPhase.UP and record.incarnation == self._context.incarnation:
            status.claimed = True
            if status.sealed:
                log.info("claimed, but the gate is shut already", extra=self._context.extra)
                return
            status.open_gate()
            self._context.emitter.emit(GateOpened, reason="handshake record claimed")
        elif phase is RecordPhase.RELEASED:
            self._on_released(record)
        elif phase in CLOSED_PHASES:  # not released (above): told to drain
            # an earlier incarnation was told to drain: carry on with that intent
            status.claimed = True
            self._claimed_incarnation = record.incarnation
            intent = record.drain or DrainIntent(
                deadline=record.at,  # due at once: the self-drain's time counts (below)
                reason=record.note or f"handshake record is {phase}",
                requested_at=record.at,
            )
            self._drain.accept(self._record_intent(intent), command=False, requested=intent)
        else:
            log.error("unexpected claim result %s", record, extra=self._context.extra)

    def _on_released(self, record: DroneRecord) -> None:
        status = self._context.status
        if status.released:
            return
        status.released = True
        status.seal_gate()
        if status.state is not S.EXITING:
            status.move(S.RELEASED)
        reason = record.note or "released by the manager before the agent came up"
        self._context.emitter.emit(Released, reason=reason)
        log.warning("drone released: %s; ending the job", reason, extra=self._context.extra)
        self._context.tasks.spawn(self._worker.end_job("released"), "end-job")

    async def watch(self) -> None:
        """Re-read the record on every hint, reconnect and heartbeat, and act on it"""
        status = self._context.status
        settle = Backoff(first=0.05, most=1.0)
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
                current = await store.read(self._context.site, self._context.drone)
            except HandshakeError as err:  # a value that is no valid record
                self._on_record_lost(f"the record does not decode ({err})")
                continue
            except (nats.errors.Error, OSError, TimeoutError) as err:
                log.debug("cannot read the record: %r", err, extra=self._context.extra)
                await asyncio.sleep(self._context.settings.reconnect_wait_s)
                self._recheck.set()  # the hint is not lost with the failed read
                continue
            if current is None:
                self._on_record_lost("the record was deleted")
                continue
            if current.revision == self._revision and self._settling > 0:
                self._settling -= 1
                wait = settle.delay()
            else:
                self._settling = 0
                settle.reset()
            self._revision = current.revision
            self._apply_record(current.record)

    def _apply_record(self, record: DroneRecord) -> None:
        """Act on the record as read while the agent is up (claimed)"""
        phase = record.phase
        if phase is RecordPhase.RELEASED:
            self._on_record_lost(f"the record says released (writer {record.writer})")
        elif record.incarnation not in (self._context.incarnation, self._claimed_incarnation):
            self._on_record_lost(
                f"the record says {phase} for another incarnation ({record.incarnation!r})"
            )
        elif phase is RecordPhase.DRAINING and record.drain is not None:
            if self._context.status.drain is None:
                log.info("the record asks for a drain", extra=self._context.extra)
                self._drain.accept(
                    self._record_intent(record.drain), command=False, requested=record.drain
                )
        elif (
            phase is not RecordPhase.UP
            and self._context.status.drain is None
            and self._context.status.state not in (S.DRAINED, S.EXITING)
        ):
            log.warning(
                "the record says %s although no drain was accepted; draining",
                phase,
                extra=self._context.extra,
            )
            self._drain.self_drain(f"handshake record is {phase}")

    def _on_record_lost(self, why: str) -> None:
        """
        The record no longer says that this agent is up: shut the gate at once, then drain

        Payloads keep running; the drain waits for them (until the self-drain
        deadline, ``--self-drain-deadline``) and ends the job as a drain does.
        The agent never writes the record again: it is not the agent's any more.
        """
        status = self._context.status
        if status.record_lost is not None:
            return
        status.record_lost = why
        self._context.counters["record_lost"] += 1
        was_open = status.seal_gate()
        log.warning(
            "handshake record lost while up: %s; gate closed, draining",
            why,
            extra=self._context.extra,
        )
        if was_open:
            self._context.emitter.emit(GateClosed, reason=f"record lost: {why}")
        if status.drain is None and status.state not in (S.DRAINED, S.EXITING):
            self._drain.self_drain(f"record lost: {why}")

    def _record_intent(self, intent: DrainIntent) -> DrainIntent:
        """
        A drain intent read from the record, due no sooner than a self-drain's

        The record's value may not be the manager's: the server stores on a
        record's subject what other drones make it send there (a reply subject
        is not checked against permissions), and the agent cannot check the
        manager's proof. A deadline, which ends in ``deadline_expired`` and so
        in the drone's removal, counts at once only when it comes as a command,
        which only the manager can send.
        """
        least = self._context.settings.self_drain_deadline_s
        if intent.duration_s >= least:
            return bounded_intent(intent)
        deadline = intent.requested_at + dt.timedelta(seconds=least)
        return bounded_intent(msgspec.structs.replace(intent, deadline=deadline))
