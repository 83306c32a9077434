"""Draining the emulated startd (``ResMgr::startDraining``) and killing its jobs"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from broker.emulation.execution_point.ads import StartdAds
from broker.emulation.execution_point.classad import ERROR, evaluate
from broker.emulation.execution_point.slots import Drain, Job

#: condor_drain's how-fast values and completion actions (``DrainType``, ``CompletionType``)
DRAIN_HOW = ("graceful", "quick", "fast")
COMPLETION = ("nothing", "resume", "exit", "restart", "reconfig")
#: startd refusals (``condor_error_codes.h``)
DRAINING_ALREADY_IN_PROGRESS = 10001
DRAINING_NO_MATCHING_REQUEST_ID = 10002
DRAINING_CHECK_EXPR_FAILED = 10003


class Draining(StartdAds):
    """Retirement, killing jobs, and ``condor_drain`` requests"""

    def _retirement_s(self, job: Job) -> float:
        value = evaluate(
            self.settings.retirement_expr, self.slot_ad(job.slot).nodes, self.job_ad(job).nodes
        )
        if isinstance(value, bool) or not isinstance(value, int | float):
            return 0.0
        return max(0.0, float(value))

    def _retirement_left(self, job: Job) -> float:
        return max(0.0, job.claimed_at + self._retirement_s(job) - time.time())

    def _schedule_kill(self, job: Job, delay_s: float, reason: str) -> None:
        if job.retire_timer is not None:
            job.retire_timer.cancel()
        if delay_s > 1e8:
            return  # "forever" (MaxJobRetirementTime = 10000000 and the like)
        job.retire_timer = asyncio.get_running_loop().call_later(delay_s, self._kill, job, reason)

    def _kill(self, job: Job, reason: str) -> None:
        if job.phase == "prepare":
            if job.kill_reason is None:
                job.kill_reason = reason
            if job.hook is not None and job.hook.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    job.hook.kill()
        elif job.phase == "running" and job.sleeper is not None and not job.sleeper.done():
            if job.kill_reason is None:
                job.kill_reason = reason
            job.sleeper.cancel()

    def start_drain(
        self,
        how: str,
        on_completion: str,
        reason: str,
        check: str | None,
        start: str | None,
    ) -> dict[str, Any]:
        """``ResMgr::startDraining``: atomic with respect to claims (one loop step)"""
        if self.drain is not None:
            return self._drain_refused(
                DRAINING_ALREADY_IN_PROGRESS,
                "Draining already in progress.",
                how,
                on_completion,
                reason,
            )
        if check is not None:
            for slot in self.slots:
                value = evaluate(check, self.slot_ad(slot).nodes)
                if value is ERROR:
                    msg = f"Failed to evaluate draining check expression against {slot.name}."
                elif not isinstance(value, bool):
                    msg = f"Draining check expression does not evaluate to a bool on {slot.name}."
                elif not value:
                    msg = f"Draining check expression is false on {slot.name}."
                else:
                    continue
                return self._drain_refused(
                    DRAINING_CHECK_EXPR_FAILED, msg, how, on_completion, reason
                )
        self.drain_requests += 1
        self.drain = Drain(str(self.drain_requests), how, on_completion, reason, start, time.time())
        self._record_request(
            True, how, on_completion, reason, check=check, request_id=self.drain.request_id
        )
        for slot in list(self.slots):
            job = slot.job
            if job is None:
                slot.enter("Drained", "Idle")
            elif how == "graceful":
                slot.enter("Claimed", "Retiring")
                self._schedule_kill(job, self._retirement_left(job), "retirement_expired")
            else:
                self._kill(job, f"drain_{how}")
        self._check_drain_done()
        return {"ok": True, "request_id": self.drain.request_id}

    def _drain_refused(
        self, code: int, message: str, how: str, on_completion: str, reason: str
    ) -> dict[str, Any]:
        self._record_request(False, how, on_completion, reason, error_code=code, message=message)
        return {"ok": False, "error_code": code, "error": message}

    def _record_request(
        self, accepted: bool, how: str, on_completion: str, reason: str, **facts: Any
    ) -> None:
        """Note a drain request in the ground truth, with what became of it"""
        self.truth.record(
            "drain_requested",
            accepted=accepted,
            how=how,
            on_completion=on_completion,
            reason=reason,
            **facts,
        )

    def cancel_drain(self, request_id: str | None) -> dict[str, Any]:
        if self.drain is None:
            if request_id is not None:
                return {
                    "ok": False,
                    "error_code": DRAINING_NO_MATCHING_REQUEST_ID,
                    "error": f"No draining request with id {request_id}.",
                }
            return {"ok": True}
        if request_id is not None and request_id != self.drain.request_id:
            return {
                "ok": False,
                "error_code": DRAINING_NO_MATCHING_REQUEST_ID,
                "error": f"No draining request with id {request_id}.",
            }
        self.truth.record("drain_cancelled", request_id=self.drain.request_id)
        self.drain = None
        self._resume_slots()
        return {"ok": True}

    def _resume_slots(self) -> None:
        for slot in self.slots:
            if slot.job is not None:
                if slot.job.retire_timer is not None:
                    slot.job.retire_timer.cancel()
                slot.enter("Claimed", "Busy")
            else:
                slot.enter("Unclaimed", "Idle")

    def _check_drain_done(self) -> None:
        drain = self.drain
        if drain is None or any(slot.job is not None for slot in self.slots):
            return
        self.truth.record(
            "drain_completed", request_id=drain.request_id, on_completion=drain.on_completion
        )
        if drain.on_completion == "exit":
            self._stop_startd("drain completed (-exit-on-completion)", held=True)
        elif drain.on_completion == "restart":
            self._stop_startd("drain completed (-restart-on-completion)", held=False)
            self._tasks.spawn(self._start_startd())
        elif drain.on_completion in ("resume", "reconfig"):
            self.drain = None
            self._resume_slots()
