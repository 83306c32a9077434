"""
The drain: close the gate for an intent, wait for the payloads, confirm idle, end the job

:meth:`Drain.accept` is synchronous: the gate closes in the same step in which
the drain is accepted, so no payload is let in after it. Only a drain command and the
drone's end move the deadline of a drain in progress, and only sooner. A deadline is
counted on the monotonic clock, as the intent's duration from when the agent received it
(:attr:`DrainIntent.duration_s`): the drone's wall clock, often wrong, never decides it.
A drain whose deadline is the drone's end vacates the payloads still running then,
whatever the deadline policy: the batch system would kill them a moment later.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import signal
import time
from asyncio import FIRST_COMPLETED

import msgspec

from remote_agent.agent.bounds import bounded_intent
from remote_agent.agent.context import AgentContext
from remote_agent.agent.steering import Steering
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

    def __init__(self, context: AgentContext, steering: Steering) -> None:
        self._context = context
        self._steering = steering
        #: set when a command moved the deadline up, so that the waiting flow looks again
        self._deadline_moved = asyncio.Event()
        #: when the drain in progress is due, on the monotonic clock
        self._due = 0.0
        #: the drone's drain point, on the monotonic clock: what runs then is vacated
        self._end_due: float | None = None
        #: the drain's deadline passed (and was acted on); the payloads were vacated
        self._expired = False
        self._vacated = False

    def accept(
        self, intent: DrainIntent, *, command: bool, requested: DrainIntent | None = None
    ) -> tuple[Outcome, str]:
        """
        Close the gate for ``intent`` and start draining; idempotent

        :param command: the drain came as a command, which only the manager can
            send: its deadline counts as it is, also for a drain in progress
            (see :meth:`_move_up`), and the intent is recorded in the handshake
            record (one read from the record is there already)
        :param requested: the intent as it was asked for, when ``intent`` holds it to
            a later deadline (a drain read from the record): ``drain_requested`` tells
            it, ``drain_accepted`` the one taken
        """
        status, emit = self._context.status, self._context.emitter.emit
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
        emit(DrainRequested, intent=bounded_intent(requested) if requested else intent)
        emit(DrainAccepted, intent=intent, payloads=count)
        if was_open:
            emit(GateClosed, reason=f"drain: {intent.reason}" if intent.reason else "drain")
        if count:
            emit(Draining, payloads=count, deadline=intent.deadline)
        self._context.tasks.spawn(self._flow(intent, command), "drain")
        return Outcome.DRAIN_ACCEPTED, self.detail()

    def detail(self) -> str:
        """The drain's progress for a command reply"""
        count = len(self._context.status.payloads)
        if not count:
            return "gate closed; no payload running, the drone is ending its job"
        drain = self._context.status.drain
        deadline = drain.deadline.isoformat() if drain else "?"
        return f"gate closed; {count} payload(s) still running, deadline {deadline}"

    def self_drain(self, reason: str) -> None:
        """Drain on the agent's own account, with the self-drain deadline"""
        intent = self._own_intent(self._context.settings.self_drain_deadline_s, reason)
        self.accept(intent, command=False)

    def _own_intent(self, duration_s: float, reason: str) -> DrainIntent:
        now = utcnow()
        deadline = now + dt.timedelta(seconds=max(0.0, duration_s))
        return DrainIntent(deadline=deadline, reason=reason, requested_at=now)

    def end_drain(self, due: float, reason: str) -> None:
        """
        The drone's end is near: drain by ``due`` (monotonic), vacating what runs then

        Starts a drain on the agent's own account, or moves the deadline of the drain in
        progress up to ``due`` (never out); either way the payloads still running at the
        deadline are vacated, whatever the deadline policy. Synchronous: the gate shuts in
        this step. Before the worker has started it does nothing: ask again once it has.
        """
        status = self._context.status
        if status.released or status.state in (S.STARTING, S.DRAINED, S.EXITING):
            return  # nothing runs yet, or the drone is ending already
        if self._end_due is not None and due >= self._end_due:
            return  # known already
        self._end_due = due
        intent = self._own_intent(due - time.monotonic(), reason)
        if status.drain is None:
            self.accept(intent, command=False)
            self._due = min(self._due, due)  # the same moment, not a rounding later
        elif status.state is S.DRAINING:
            self._move_up(intent, by="the drone's end")
            self._deadline_moved.set()  # also a drain past its deadline: it vacates then

    def _move_up(self, intent: DrainIntent, by: str = "a command") -> None:
        """
        Tighten the drain in progress to ``intent``, if that is due sooner

        The drain may have come from the record, whose deadline counts no sooner
        than a self-drain's, or from the agent itself; the manager's command
        that follows it sets the deadline TARDIS asked for, and the drone's end
        may come sooner still. A later deadline changes nothing: a drain's deadline
        never moves out. The drain keeps its request and reason and takes the new
        intent's times; ``draining`` tells the new deadline.
        """
        status = self._context.status
        drain = status.drain
        due = time.monotonic() + intent.duration_s
        if drain is None or status.state is not S.DRAINING or due >= self._due:
            return
        log.info(
            "drain deadline moved up by %s: due in %.0fs instead of %.0fs",
            by,
            intent.duration_s,
            self._left(),
            extra=self._context.extra,
        )
        self._due = due
        status.drain = msgspec.structs.replace(
            drain, deadline=intent.deadline, requested_at=intent.requested_at
        )
        self._deadline_moved.set()
        self._context.emitter.emit(
            Draining, payloads=len(status.payloads), deadline=intent.deadline
        )

    def _left(self) -> float:
        """Seconds until the drain in progress is due (negative once it is)"""
        return self._due - time.monotonic()

    async def _flow(self, intent: DrainIntent, command: bool) -> None:
        context, steering = self._context, self._steering
        if command:
            await steering.record.request_drain(intent)
        await steering.startd.stop(intent.reason)
        while True:
            await self._wait_payloads()
            if await steering.startd.confirm_idle():
                break
            if self._left() <= 0 and not self._expired:
                self._expired = True
                await self._deadline_expired(intent)
            if self._at_end() and not self._vacated:
                # the deadline had passed under the "wait" policy; now the drone's end is near
                await self._vacate("the drone's end")
            # the snapshot may be empty (a JOB_EXIT, forged or early) while the startd
            # still lists jobs or claims: look again after a poll interval
            await asyncio.sleep(context.settings.poll_s)
        await steering.record.finish(RecordPhase.DRAINED, intent.reason)
        if context.status.state is S.DRAINING:
            context.status.move(S.DRAINED)
            context.emitter.emit(Drained)
        await steering.worker.end_job(
            "drained at the drone's end" if self._end_due is not None else "drained",
            exits_itself=steering.startd.exits_when_empty,
        )

    async def _deadline_expired(self, intent: DrainIntent) -> None:
        context, steering = self._context, self._steering
        count = max(len(context.status.payloads), steering.startd.busy_slots)
        end = self._at_end()
        policy = "kill" if end else context.settings.deadline_policy
        log.warning(
            "drain deadline passed with %d payload(s) running; %s",
            count,
            "the drone's end is near: vacating them" if end else f"policy {policy}",
            extra=context.extra,
        )
        context.emitter.emit(DrainDeadlineExpired, payloads=count, action=policy)
        await steering.record.finish(
            RecordPhase.DEADLINE_EXPIRED, f"{count} payload(s) running at the deadline"
        )
        if policy == "kill":
            await self._vacate("the drone's end" if end else "drain deadline expired")

    def _at_end(self) -> bool:
        """Whether the drone's drain point has come"""
        return self._end_due is not None and self._end_due <= time.monotonic()

    def _until_action(self) -> float | None:
        """Seconds until the flow acts: at the deadline, at the drain point; ``None``: never"""
        due = [] if self._expired else [self._due]
        if self._end_due is not None and not self._vacated:
            due.append(self._end_due)
        return min(due) - time.monotonic() if due else None

    async def _wait_payloads(self) -> bool:
        """
        Wait for the last payload to end, or for the deadline or the drain point to act on;
        ``True`` if none runs

        A deadline moved up meanwhile, or a drain point learned, ends the wait then.
        """
        done = self._steering.ledger.done
        while not done.is_set():
            remaining = self._until_action()
            if remaining is not None and remaining <= 0:
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
        return not self._context.status.payloads

    async def _vacate(self, why: str) -> None:
        """
        Evict every payload through the startd (``condor_drain -fast``), which puts them
        back into the overlay pool's queue; without a startd, end the worker

        At the drone's end, a startd that refuses or cannot be asked gets the master's fast
        shutdown (SIGQUIT), which evicts too, as GlideinWMS's glideins do on SIGTERM.
        """
        steering = self._steering
        if self._vacated:
            return
        self._vacated = True
        self._context.status.ending = why
        count = steering.ledger.vacating()
        if steering.startd.startd is None:
            # without a startd the payloads are the worker's business: end the worker
            await steering.worker.terminate()
            return
        log.info("vacating %d payload(s): %s", count, why, extra=self._context.extra)
        if not await steering.startd.drain(why, fast=True) and self._end_due is not None:
            log.warning(
                "the startd did not take the vacate; the worker shuts down fast instead",
                extra=self._context.extra,
            )
            steering.worker.forward(signal.SIGQUIT)
