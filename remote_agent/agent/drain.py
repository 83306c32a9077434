"""
The drain: close the gate for an intent, wait for the payloads, confirm idle, end the job

:meth:`Drain.accept` is synchronous: the gate closes in the same step in which
the drain is accepted, so no payload is let in after it. Only a drain command
moves the deadline of a drain in progress, and only sooner. A deadline is counted on
the monotonic clock, as the intent's duration from when the agent received it
(:attr:`DrainIntent.duration_s`): the drone's wall clock, often wrong, never decides it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from asyncio import FIRST_COMPLETED

import msgspec

from remote_agent.agent.bounds import bounded_intent
from remote_agent.agent.controls import Controls
from remote_agent.agent.parts import Parts
from remote_agent.protocol.events import (
    DrainAccepted,
    DrainDeadlineExpired,
    Drained,
    Draining,
    DrainIntent,
    DrainRefused,
    DrainRequested,
    DroneState,
    GateClosed,
    Outcome,
    RecordPhase,
    utcnow,
)

log = logging.getLogger("remote_agent.agent")

S = DroneState


class Drain:
    """Accepts drain intents (commands, the record, the agent itself) and carries them out"""

    def __init__(self, parts: Parts, controls: Controls) -> None:
        self._parts = parts
        self._controls = controls
        #: set when a command moved the deadline up, so that the waiting flow looks again
        self._deadline_moved = asyncio.Event()
        #: when the drain in progress is due, on the monotonic clock
        self._due = 0.0

    def accept(self, intent: DrainIntent, *, command: bool) -> tuple[Outcome, str]:
        """
        Close the gate for ``intent`` and start draining; idempotent

        :param command: the drain came as a command, which only the manager can
            send: its deadline counts as it is, also for a drain in progress
            (see :meth:`_move_up`), and the intent is recorded in the handshake
            record (one read from the record is there already)
        """
        status, emit = self._parts.status, self._parts.emitter.emit
        state = status.state
        if status.released:
            reason = "the drone was released before its agent came up; it is ending"
            emit(DrainRefused, request_id=intent.request_id, reason=reason)
            return Outcome.REFUSED, reason
        if status.drain is not None:
            if state is S.DRAINED:
                return Outcome.DRAINED, "drained; the drone is ending its job"
            if command:
                self._move_up(intent)
            if intent.request_id and intent.request_id == status.drain.request_id:
                return Outcome.DRAIN_ACCEPTED, self.detail()
            return Outcome.ALREADY_DRAINING, (
                f"draining for request {status.drain.request_id!r} until "
                f"{status.drain.deadline.isoformat()}; {self.detail()}"
            )
        if state is S.DRAINED:
            return Outcome.DRAINED, "drained; the drone is ending its job"
        if state is S.EXITING:
            reason = "the agent is exiting"
            emit(DrainRefused, request_id=intent.request_id, reason=reason)
            return Outcome.REFUSED, reason
        intent = bounded_intent(intent)
        status.drain = intent
        self._due = time.monotonic() + intent.duration_s
        was_open = status.seal_gate()
        status.move(S.DRAINING)
        count = len(status.payloads)
        emit(DrainRequested, intent=intent)
        emit(DrainAccepted, intent=intent, payloads=count)
        if was_open:
            emit(GateClosed, reason=f"drain: {intent.reason}" if intent.reason else "drain")
        if count:
            emit(Draining, payloads=count, deadline=intent.deadline)
        self._parts.tasks.spawn(self._flow(intent, command), "drain")
        return Outcome.DRAIN_ACCEPTED, self.detail()

    def detail(self) -> str:
        """The drain's progress for a command reply"""
        count = len(self._parts.status.payloads)
        if not count:
            return "gate closed; no payload running, the drone is ending its job"
        drain = self._parts.status.drain
        deadline = drain.deadline.isoformat() if drain else "?"
        return f"gate closed; {count} payload(s) still running, deadline {deadline}"

    def self_drain(self, reason: str) -> None:
        """Drain on the agent's own account, with the self-drain deadline"""
        now = utcnow()
        deadline = now + dt.timedelta(seconds=self._parts.settings.self_drain_deadline_s)
        intent = DrainIntent(deadline=deadline, reason=reason, requested_at=now)
        self.accept(intent, command=False)

    def _move_up(self, command: DrainIntent) -> None:
        """
        Tighten the drain in progress to a command's intent, if that is due sooner

        The drain may have come from the record, whose deadline counts no sooner
        than a self-drain's, or from the agent itself; the manager's command
        that follows it sets the deadline TARDIS asked for. A later deadline
        changes nothing: a drain's deadline never moves out. The drain keeps
        its request and reason and takes the command's times; ``draining`` tells
        the new deadline.
        """
        status = self._parts.status
        drain = status.drain
        due = time.monotonic() + command.duration_s
        if drain is None or status.state is not S.DRAINING or due >= self._due:
            return
        log.info(
            "drain deadline moved up by a command: due in %.0fs instead of %.0fs",
            command.duration_s,
            self._left(),
            extra=self._parts.extra,
        )
        self._due = due
        status.drain = msgspec.structs.replace(
            drain, deadline=command.deadline, requested_at=command.requested_at
        )
        self._deadline_moved.set()
        self._parts.emitter.emit(Draining, payloads=len(status.payloads), deadline=command.deadline)

    def _left(self) -> float:
        """Seconds until the drain in progress is due (negative once it is)"""
        return self._due - time.monotonic()

    async def _flow(self, intent: DrainIntent, command: bool) -> None:
        parts, controls = self._parts, self._controls
        if command:
            await controls.record.request_drain(intent)
        await controls.startd.stop(intent.reason)
        expired = False
        while True:
            if not expired:
                await self._wait_payloads()
            else:
                await controls.ledger.done.wait()
            if await controls.startd.confirm_idle():
                break
            if not expired and self._left() <= 0:
                expired = True
                await self._deadline_expired(intent)
            # the snapshot may be empty (a JOB_EXIT, forged or early) while the startd
            # still lists jobs or claims: look again after a poll interval
            await asyncio.sleep(parts.settings.poll_s)
        await controls.record.finish(RecordPhase.DRAINED, intent.reason)
        if parts.status.state is S.DRAINING:
            parts.status.move(S.DRAINED)
            parts.emitter.emit(Drained)
        await controls.worker.end_job("drained", exits_itself=controls.startd.exits_when_empty)

    async def _deadline_expired(self, intent: DrainIntent) -> None:
        parts, controls = self._parts, self._controls
        count = max(len(parts.status.payloads), controls.startd.busy_slots)
        policy = parts.settings.deadline_policy
        log.warning(
            "drain deadline passed with %d payload(s) running; policy %s",
            count,
            policy,
            extra=parts.extra,
        )
        parts.emitter.emit(DrainDeadlineExpired, payloads=count, action=policy)
        await controls.record.finish(
            RecordPhase.DEADLINE_EXPIRED, f"{count} payload(s) running at the deadline"
        )
        if policy == "kill":
            parts.status.ending = "drain deadline expired"
            await self._kill_payloads(intent.reason)

    async def _wait_payloads(self) -> bool:
        """
        Wait for the last payload to end, until the deadline; ``True`` if none runs

        A deadline moved up meanwhile ends the wait at the new deadline.
        """
        done = self._controls.ledger.done
        while not done.is_set():
            remaining = self._left()
            if remaining <= 0:
                break
            self._deadline_moved.clear()
            waiters = (
                asyncio.ensure_future(done.wait()),
                asyncio.ensure_future(self._deadline_moved.wait()),
            )
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        return not self._parts.status.payloads

    async def _kill_payloads(self, reason: str) -> None:
        if self._controls.startd.startd is not None:
            await self._controls.startd.drain(reason, fast=True)
        else:
            # without a startd the payloads are the worker's business: end the worker
            await self._controls.worker.terminate()
