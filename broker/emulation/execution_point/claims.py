"""Claiming a slot for an offered job, running its payload, releasing the slot"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from broker.emulation.execution_point.classad import Ad, evaluate
from broker.emulation.execution_point.drain import Draining
from broker.emulation.execution_point.hooks import JobHooks
from broker.emulation.execution_point.slots import Job, Slot


class Claims(JobHooks, Draining):
    """Offering a job: matching it to a slot, claiming it, running and releasing it"""

    def _start_true(self, slot: Slot, job_ad: Ad) -> bool:
        expr = self.settings.start_expr
        if self.drain is not None:
            # while draining START is the -start expression, else undefined: no match
            if self.drain.start_expr is None:
                return False
            expr = self.drain.start_expr
        return evaluate(expr, self.slot_ad(slot).nodes, job_ad.nodes) is True

    def _pick_slot(self, job: Job) -> tuple[Slot | None, str]:
        probe = self.job_ad(job)
        if self.settings.partitionable:
            parent = self.slots[0]
            used = sum(s.cpus for s in self.slots[1:])
            if parent.cpus - used < 1:
                return None, "no free slot"
            if not self._start_true(parent, probe):
                return None, "draining" if self.drain else "START is false"
            slot = Slot(
                f"slot1_{parent.next_dynamic}@{self.settings.startd_name}",
                1,
                "Dynamic",
                1,
            )
            parent.next_dynamic += 1
            self.slots.append(slot)
            return slot, ""
        free = [slot for slot in self.slots if slot.job is None and slot.state == "Unclaimed"]
        if not free and self.drain is None:
            return None, "no free slot"
        for slot in free:
            if self._start_true(slot, probe):
                return slot, ""
        if self.drain is not None:
            return None, "draining"
        return None, "START is false"

    def _release(self, job: Job) -> None:
        slot = job.slot
        job.phase = "done"
        if job.retire_timer is not None:
            job.retire_timer.cancel()
        slot.job = None
        self._no_jobs.set()
        if slot.kind == "Dynamic":
            with contextlib.suppress(ValueError):
                self.slots.remove(slot)
        elif self.drain is not None:
            slot.enter("Drained", "Idle")
        else:
            slot.enter("Unclaimed", "Idle")
        self._check_drain_done()

    async def offer(
        self,
        job_id: str,
        duration_s: float,
        exit_code: int,
        owner: str,
        attributes: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """
        Offer one job, as the overlay pool's negotiator and schedd would

        :param attributes: more attributes of its job ad (numbers, strings, booleans)
        """
        if self.shutting_down or not self.startd_ready:
            reason = "shutting down" if self.shutting_down else "no startd"
            self.truth.record("offer_rejected", job_id=job_id, reason=reason)
            return {"outcome": "rejected", "reason": reason}
        self.jobs += 1
        placeholder = Slot("", 0, "Static", 1)
        job = Job(job_id, owner, duration_s, exit_code, placeholder, time.time(), self.jobs)
        job.attributes = dict(attributes or {})
        slot, reason = self._pick_slot(job)
        if slot is None:
            self.truth.record("offer_rejected", job_id=job_id, reason=reason)
            return {"outcome": "rejected", "reason": reason}
        job.slot = slot
        slot.job = job
        # the claim is activated before the starter runs PREPARE_JOB
        slot.enter("Claimed", "Busy")
        self.truth.record("claimed", job_id=job_id, slot=slot.name)
        decision, detail = await self._prepare_job(job)
        if job.kill_reason is not None:
            self.truth.record(
                "payload_vacated", job_id=job_id, slot=slot.name, reason=job.kill_reason
            )
            self._release(job)
            return {"outcome": "vacated", "reason": job.kill_reason, "slot": slot.name}
        if decision != "run":
            event = "payload_held" if decision == "hold" else "payload_refused"
            self.truth.record(event, job_id=job_id, slot=slot.name, **detail)
            self._release(job)
            return {
                "outcome": "held" if decision == "hold" else "idle",
                "slot": slot.name,
                **detail,
            }
        job.phase = "running"
        job.started_at, job.started_mono = time.time(), time.monotonic()
        job.sleeper = asyncio.get_running_loop().create_task(asyncio.sleep(duration_s))
        self.truth.record("payload_started", job_id=job_id, slot=slot.name, duration_s=duration_s)
        self._tasks.spawn(self._run_payload(job))
        if self._stopping_fast():  # a shutdown may have begun while PREPARE_JOB ran
            self._kill(job, "shutdown_fast")
        elif self.drain is not None and self.drain.how == "graceful":
            slot.enter("Claimed", "Retiring")
            self._schedule_kill(job, self._retirement_left(job), "retirement_expired")
        elif self.drain is not None:
            self._kill(job, f"drain_{self.drain.how}")
        return {"outcome": "started", "slot": slot.name}

    def _stopping_fast(self) -> bool:
        return self.shutting_down == "fast"

    async def _run_payload(self, job: Job) -> None:
        assert job.sleeper is not None
        this = asyncio.current_task()
        how, exit_code = "exit", job.exit_code
        try:
            await job.sleeper
        except asyncio.CancelledError:
            if this is not None and this.cancelling():
                raise  # the emulator itself is stopping
            how, exit_code = "evict", -9
        runtime = time.monotonic() - (job.started_mono or time.monotonic())
        if how == "exit":
            self.truth.record(
                "payload_finished",
                job_id=job.job_id,
                slot=job.slot.name,
                exit_code=exit_code,
                runtime_s=round(runtime, 3),
            )
        else:
            self.truth.record(
                "payload_killed",
                job_id=job.job_id,
                slot=job.slot.name,
                reason=job.kill_reason,
                runtime_s=round(runtime, 3),
            )
        job.phase = "exit_hook"
        await self._job_exit_hook(job, how, exit_code, runtime)
        self._release(job)
