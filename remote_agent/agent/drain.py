"""
The drain: close the gate for an intent, wait for the payloads, confirm idle, end the job

:meth:`Drain.accept` is synchronous: the gate closes in the same step in which
the drain is accepted, so no payload is let in after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

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

    def accept(self, intent: DrainIntent, *, write_intent: bool) -> tuple[Outcome, str]:
        """
        Close the gate for ``intent`` and start draining; idempotent

        :param write_intent: record the intent in the handshake record (a drain
            that came as a command; one read from the record is there already)
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
        was_open = status.seal_gate()
        status.move(S.DRAINING)
        count = len(status.payloads)
        emit(DrainRequested, intent=intent)
        emit(DrainAccepted, intent=intent, payloads=count)
        if was_open:
            emit(GateClosed, reason=f"drain: {intent.reason}" if intent.reason else "drain")
        if count:
            emit(Draining, payloads=count, deadline=intent.deadline)
        self._parts.tasks.spawn(self._flow(intent, write_intent), "drain")
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
        self.accept(intent, write_intent=False)

    async def _flow(self, intent: DrainIntent, write_intent: bool) -> None:
        parts, controls = self._parts, self._controls
        if write_intent:
            await controls.record.request_drain(intent)
        await controls.startd.stop(intent.reason)
        expired = False
        while True:
            if not expired:
                await self._wait_payloads(intent.deadline)
            else:
                await controls.ledger.done.wait()
            if await controls.startd.confirm_idle():
                break
            if not expired and utcnow() >= intent.deadline:
                expired = True
                await self._deadline_expired(intent)
            # the snapshot may be empty (a JOB_EXIT, forged or early) while the startd
            # still lists jobs or claims: look again after a poll interval
            await asyncio.sleep(parts.settings.poll_s)
        await controls.record.finish(RecordPhase.DRAINED, intent.reason)
        if parts.status.state is S.DRAINING:
            parts.status.move(S.DRAINED)
            parts.emitter.emit(Drained)
        await controls.worker.end_job("drained")

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

    async def _wait_payloads(self, deadline: dt.datetime) -> bool:
        """Wait for the last payload to end, until ``deadline``; ``True`` if none runs"""
        remaining = (deadline - utcnow()).total_seconds()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._controls.ledger.done.wait(), max(remaining, 0.0))
        return not self._parts.status.payloads

    async def _kill_payloads(self, reason: str) -> None:
        if self._controls.startd.startd is not None:
            await self._controls.startd.drain(reason, fast=True)
        else:
            # without a startd the payloads are the worker's business: end the worker
            await self._controls.worker.terminate()
