"""
The payloads' bookkeeping: admission at the gate, ends, adoption, what is remembered

Every method is synchronous: an admission and a drain never interleave. The
tables are bounded, so a flood of forged job ids costs no memory. A payload leaves
the snapshot when the startd no longer lists it: a ``JOB_EXIT`` report is held until
the startd's listing confirms it (any process on the drone can send one).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from remote_agent.agent.bounds import cut
from remote_agent.agent.context import AgentContext
from remote_agent.interfaces import (
    END_REFUSED_STATUS,
    GATE_CLOSED_STATUS,
    GateDecision,
    JobStart,
    SlotInfo,
)
from remote_agent.protocol.events import (
    Payload,
    PayloadEnd,
    PayloadFinished,
    PayloadStarted,
    utcnow,
)
from remote_agent.protocol.fields import MAX_JOB_ID, MAX_NAME, MAX_PAYLOADS
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("remote_agent.agent")
_rejections = RateLimitedLog(log)

#: how long a refused or finished job id is remembered, so a late poll does not adopt it
_FORGET_S = 600.0
#: refused and finished job ids remembered at most (a flood of forged ids costs no memory)
_MAX_REMEMBERED = 4096


def _remember(table: dict[str, float], job_id: str) -> None:
    table.pop(job_id, None)
    table[job_id] = time.monotonic()
    while len(table) > _MAX_REMEMBERED:
        del table[next(iter(table))]


class PayloadLedger:
    """The payloads in :attr:`DroneStatus.payloads` and the job ids seen around them"""

    def __init__(self, context: AgentContext) -> None:
        self._context = context
        # on the gate's path: kept at hand
        self._status = context.status
        self._emitter = context.emitter
        self._counters = context.counters
        #: set while no payload runs
        self.done = asyncio.Event()
        self.done.set()
        #: payloads let in (or adopted) so far: a release-if-idle that saw another
        #: number before it asked the startd lets nothing go
        self.admitted = 0
        self._refused: dict[str, float] = {}
        self._finished: dict[str, float] = {}
        self._unknown_seen: set[str] = set()
        self._missing: dict[str, int] = {}
        #: when each running payload started, on the monotonic clock: its runtime is
        #: counted there, not by the wall clock of its ``started_at``, which may jump
        self._started: dict[str, float] = {}
        #: JOB_EXIT reports of payloads the startd still listed when last asked, by job id
        self._exits: dict[str, tuple[PayloadEnd, int | None, float | None]] = {}
        #: asks the startd soon whether reported payloads still run (then
        #: :meth:`confirm_exits`); ``None``: no startd to ask, a report is taken at its word
        self.confirm: Callable[[], None] | None = None
        #: reported payloads a listing showed running since their newest report (counted once)
        self._contradicted: set[str] = set()
        #: payloads the agent asked the startd to evict: their evictions are vacates
        self._vacating: set[str] = set()

    @property
    def capacity(self) -> int:
        """How many payloads the gate lets run at once: the slots, at most :data:`MAX_PAYLOADS`"""
        slots = self._status.slots
        return min(slots, MAX_PAYLOADS) if slots > 0 else MAX_PAYLOADS

    def prepare_job(self, job: JobStart) -> GateDecision:
        """Allow the payload (and publish it) if the gate is open (see ``Agent.prepare_job``)"""
        payloads = self._status.payloads
        if not self._status.gate_open:
            reason = self._status.closed_reason()
            return self._refuse(job, reason, "payloads_refused", log_level=None)
        if job.job_id in payloads:
            return GateDecision(allow=True, message="already running")
        if len(job.job_id) > MAX_JOB_ID:
            reason = f"job id longer than {MAX_JOB_ID} characters"
            return self._refuse(job, reason, "payloads_refused_job_id")
        capacity = self.capacity
        if len(payloads) >= capacity:
            reason = f"all {capacity} slot(s) of the drone run payloads already"
            return self._refuse(job, reason, "payloads_refused_over_slots")
        requested = job.requested_s
        if requested is not None and not 0 <= requested < math.inf:
            requested = None
        settings = self._context.settings
        runtime = settings.payload_runtime_s if requested is None else requested
        why = self._status.end_refusal(runtime, settings.end_margin_s)
        if why is not None:
            reason = f"cannot finish before the drone's end: {why}"
            return self._refuse(
                job, reason, "payloads_refused_end", log_level=None, code=END_REFUSED_STATUS
            )
        slot = job.slot
        if len(slot) > MAX_NAME:
            self._counters["strings_cut"] += 1
            slot = cut(slot, MAX_NAME)
        self._start(job.job_id, slot, requested)
        self.admitted += 1
        self._changed()
        self._counters["payloads_allowed"] += 1
        self._emitter.emit(PayloadStarted, job_id=job.job_id, slot=slot)
        return GateDecision(allow=True)

    def _refuse(
        self,
        job: JobStart,
        reason: str,
        counter: str,
        log_level: int | None = logging.WARNING,
        code: int = GATE_CLOSED_STATUS,
    ) -> GateDecision:
        """
        Refuse ``job``, counted as ``counter`` (``payloads_refused`` is a closed gate's)

        :param log_level: a warning, rate-limited, for refusals that hint at a fault;
            ``None``: an INFO line, the drone does what it should
        """
        _remember(self._refused, job.job_id)
        self._counters["payloads_refused"] += 1
        if counter != "payloads_refused":
            self._counters[counter] += 1
        extra = {"drone": self._context.drone, "job_id": job.job_id[:MAX_JOB_ID]}
        if log_level is None:
            log.info("refused payload %s: %s", job.job_id, reason, extra=extra)
        else:
            _rejections.log(
                log_level, counter, "refused payload %r: %s", job.job_id, reason, extra=extra
            )
        return GateDecision(allow=False, status_code=code, message=reason)

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        """JOB_EXIT: the payload ended; publish it (only a hint, see ``Agent.job_exited``)"""
        if job_id not in self._status.payloads:
            if job_id in self._finished or job_id in self._refused:
                log.debug("job exit of %s: known already", job_id, extra=self._context.extra)
                return
            self._counters["job_exit_unknown"] += 1
            _rejections.warning(
                "job_exit_unknown",
                "job exit of %r, which the gate never saw; ignored",
                job_id,
                extra=self._context.extra,
            )
            _remember(self._finished, job_id)
            return
        if self.confirm is None:
            self.finish(job_id, how, exit_code, duration_s)
            return
        self._exits[job_id] = (how, exit_code, duration_s)  # the newest report counts
        self._contradicted.discard(job_id)
        self.confirm()

    def confirm_exits(self, slots: list[SlotInfo]) -> None:
        """Finish the reported payloads ``slots`` (the startd's listing) no longer run"""
        running = {slot.job_id for slot in slots if slot.job_id}
        for job_id in list(self._exits):
            if job_id not in self._status.payloads:
                del self._exits[job_id]
                self._contradicted.discard(job_id)
            elif job_id not in running:
                self.finish(job_id, *self._exits[job_id])
            elif job_id not in self._contradicted:
                # a payload in output transfer, or a report that is not true (yet)
                self._contradicted.add(job_id)
                self._counters["job_exits_unconfirmed"] += 1
                log.debug(
                    "job exit of %s: the startd still runs it", job_id, extra=self._context.extra
                )

    def finish(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        """The payload ``job_id`` ended: it leaves the snapshot"""
        payload = self._status.payloads.pop(job_id, None)
        started = self._started.pop(job_id, None)
        self._missing.pop(job_id, None)
        self._exits.pop(job_id, None)
        self._contradicted.discard(job_id)
        vacated = how is PayloadEnd.EVICT and job_id in self._vacating
        self._vacating.discard(job_id)
        _remember(self._finished, job_id)
        if duration_s is None and started is not None:
            duration_s = time.monotonic() - started
        if duration_s is not None and not 0 <= duration_s < math.inf:
            duration_s = None
        self._changed()
        self._emitter.emit(
            PayloadFinished,
            job_id=job_id,
            slot=payload.slot if payload is not None else "",
            how=how,
            exit_code=exit_code,
            duration_s=duration_s,
            vacated=vacated,
        )
        if vacated:
            self._counters["payloads_vacated"] += 1

    def vacating(self) -> int:
        """
        The agent asks the startd to evict every payload now: an eviction that follows is a
        vacate (the overlay pool queues the job again); the number of payloads
        """
        self._vacating = set(self._status.payloads)
        return len(self._vacating)

    def finish_all(self) -> bool:
        """The worker ended: so did every payload; ``True`` if one was left unreported"""
        left = [job_id for job_id in self._status.payloads if job_id not in self._exits]
        for job_id in list(self._status.payloads):
            self.finish(job_id, *self._exits.get(job_id, (PayloadEnd.UNKNOWN, None, None)))
        return bool(left)

    def _changed(self) -> None:
        if self._status.payloads:
            self.done.clear()
        else:
            self.done.set()
        self._status.payloads_changed()

    def unknown_jobs(self, slots: list[SlotInfo]) -> dict[str, str]:
        """Jobs running in ``slots`` that are no payload of ours, by id, with their slot"""
        return {
            slot.job_id: slot.name
            for slot in slots
            if slot.job_id
            and slot.job_id not in self._status.payloads
            and slot.job_id not in self._refused  # refused: listed until its starter exits
            and slot.job_id not in self._finished  # JOB_EXIT runs before output transfer
        }

    def adopt(self, job_id: str, slot: str, why: str) -> None:
        """Count a payload that runs although the gate never let it in"""
        payloads = self._status.payloads
        if len(job_id) > MAX_JOB_ID or len(payloads) >= MAX_PAYLOADS:
            # not in the snapshot, but the startd lists it: the drone is not idle
            self._counters["payloads_not_listed"] += 1
            return
        slot = cut(slot, MAX_NAME)
        self.admitted += 1
        log.warning(
            "payload %s never passed the gate but runs (%s); counting it",
            job_id,
            why,
            extra={"drone": self._context.drone, "job_id": job_id},
        )
        self._start(job_id, slot)
        self._changed()
        self._emitter.emit(PayloadStarted, job_id=job_id, slot=slot)

    def _start(self, job_id: str, slot: str, requested_s: float | None = None) -> None:
        """Enter ``job_id`` into the snapshot's payloads, started now"""
        self._status.payloads[job_id] = Payload(
            job_id=job_id, slot=slot, started_at=utcnow(), requested_s=requested_s
        )
        self._started[job_id] = time.monotonic()

    def adopt_unknown(self, slots: list[SlotInfo], why: str) -> None:
        """Adopt every job in ``slots`` that is no payload of ours"""
        for job_id, slot_name in self.unknown_jobs(slots).items():
            self.adopt(job_id, slot_name, why)

    def reconcile(self, slots: list[SlotInfo]) -> None:
        """Finish payloads that vanished without a JOB_EXIT; adopt ones the gate never saw"""
        now = time.monotonic()
        for table in (self._refused, self._finished):
            for job_id in [j for j, at in table.items() if now - at > _FORGET_S]:
                del table[job_id]
        self.confirm_exits(slots)
        running = {slot.job_id for slot in slots if slot.job_id}
        for job_id in list(self._status.payloads):
            if job_id in running:
                self._missing.pop(job_id, None)
                continue
            if now - self._started.get(job_id, 0.0) < self._context.settings.poll_s:
                continue  # too young to be listed yet
            self._missing[job_id] = misses = self._missing.get(job_id, 0) + 1
            if misses >= 2:
                log.warning(
                    "payload %s vanished without a JOB_EXIT hook",
                    job_id,
                    extra={"drone": self._context.drone, "job_id": job_id},
                )
                self.finish(job_id, PayloadEnd.UNKNOWN, None, None)
        unknown = self.unknown_jobs(slots)
        for job_id in sorted(unknown.keys() & self._unknown_seen):
            # listed in two polls in a row: the hooks are not configured, or an earlier
            # agent let it in; either way it runs, so it counts
            self.adopt(job_id, unknown[job_id], "seen in two polls")
        self._unknown_seen = set(unknown) - set(self._status.payloads)
