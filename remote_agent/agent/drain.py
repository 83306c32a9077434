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
from remote_agent.agent.emission import Emitter
from remote_agent.agent.payloads import PayloadLedger
from remote_agent.agent.record import RecordClient
from remote_agent.agent.startd import StartdObserver
from remote_agent.agent.status import DroneStatus
from remote_agent.agent.tasks import Tasks
from remote_agent.agent.worker import Worker
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
from remote_agent.settings import Settings

log = logging.getLogger("remote_agent.agent")

S = DroneState


class Drain:
    """Accepts drain intents (commands, the record, the agent itself) and carries them out"""

    def __init__(
        self,
        settings: Settings,
        status: DroneStatus,
        emitter: Emitter,
        ledger: PayloadLedger,
        record: RecordClient,
        startd: StartdObserver,
        worker: Worker,
        tasks: Tasks,
    ) -> None:
        self._settings = settings
        self._status = status
        self._emitter = emitter
        self._ledger = ledger
        self._record = record
        self._startd = startd
        self._worker = worker
        self._tasks = tasks
        self._drone = settings.drone

    def accept(self, intent: DrainIntent, *, write_intent: bool) -> tuple[Outcome, str]:
        """
        Close the gate for ``intent`` and start draining; idempotent

        :param write_intent: record the intent in the handshake record (a drain
            that came as a command; one read from the record is there already)
        """
        status, emit = self._status, self._emitter.emit
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
        self._tasks.spawn(self._flow(intent, write_intent), "drain")
        return Outcome.DRAIN_ACCEPTED, self.detail()

    def detail(self) -> str:
        """The drain's progress for a command reply"""
        count = len(self._status.payloads)
        if not count:
            return "gate closed; no payload running, the drone is ending its job"
        drain = self._status.drain
        deadline = drain.deadline.isoformat() if drain else "?"
        return f"gate closed; {count} payload(s) still running, deadline {deadline}"

    def self_drain(self, reason: str) -> None:
        """Drain on the agent's own account, with the self-drain deadline"""
        now = utcnow()
        deadline = now + dt.timedelta(seconds=self._settings.self_drain_deadline_s)
        intent = DrainIntent(deadline=deadline, reason=reason, requested_at=now)
        self.accept(intent, write_intent=False)

    async def _flow(self, intent: DrainIntent, write_intent: bool) -> None:
        if write_intent:
            await self._record.request_drain(intent)
        await self._startd.stop(intent.reason)
        expired = False
        while True:
            if not expired:
                await self._wait_payloads(intent.deadline)
            else:
                await self._ledger.done.wait()
            if await self._startd.confirm_idle():
                break
            if not expired and utcnow() >= intent.deadline:
                expired = True
                await self._deadline_expired(intent)
            # the snapshot may be empty (a JOB_EXIT, forged or early) while the startd
            # still lists jobs or claims: look again after a poll interval
            await asyncio.sleep(self._settings.poll_s)
        await self._record.finish(RecordPhase.DRAINED, intent.reason)
        if self._status.state is S.DRAINING:
            self._status.move(S.DRAINED)
            self._emitter.emit(Drained)
        await self._worker.end_job("drained")

    async def _deadline_expired(self, intent: DrainIntent) -> None:
        count = max(len(self._status.payloads), self._startd.busy_slots)
        policy = self._settings.deadline_policy
        log.warning(
            "drain deadline passed with %d payload(s) running; policy %s",
            count,
            policy,
            extra={"drone": self._drone},
        )
        self._emitter.emit(DrainDeadlineExpired, payloads=count, action=policy)
        await self._record.finish(
            RecordPhase.DEADLINE_EXPIRED, f"{count} payload(s) running at the deadline"
        )
        if policy == "kill":
            self._status.ending = "drain deadline expired"
            await self._kill_payloads(intent.reason)

    async def _wait_payloads(self, deadline: dt.datetime) -> bool:
        """Wait for the last payload to end, until ``deadline``; ``True`` if none runs"""
        remaining = (deadline - utcnow()).total_seconds()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ledger.done.wait(), max(remaining, 0.0))
        return not self._status.payloads

    async def _kill_payloads(self, reason: str) -> None:
        if self._startd.startd is not None:
            await self._startd.drain(reason, fast=True)
        else:
            # without a startd the payloads are the worker's business: end the worker
            await self._worker.terminate()
