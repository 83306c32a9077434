"""
A stand-in for the overlay pool: a queue of jobs matched to emulated drones

Each negotiation cycle offers every idle job to the drones in turn until one
starts it, as a negotiator and schedd would (without ranks, groups or claim
reuse). A job a drone sends back to idle (``HookStatusCode`` >= 300, a closed
``START``) stays idle and is offered again next cycle; a held job stays held; a
payload that a drone killed returns to idle, as an evicted vanilla job does, and
counts as badput. Job states come from the drones' ground truth, so the pool
needs nothing from the agents or the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.execution_point.control import EmulatorControl


@dataclasses.dataclass
class PoolJob:
    job_id: str
    duration_s: float
    exit_code: int = 0
    status: str = "idle"  #: idle, running, done, held
    drone: int | None = None  #: index of the drone running it
    starts: int = 0
    evictions: int = 0
    refusals: int = 0


class OverlayPool:
    """Jobs and drones; call :meth:`negotiate` periodically, or :meth:`run` until stopped"""

    def __init__(self, drones: Sequence[EmulatorControl], *, seed: int | None = None) -> None:
        self.drones = list(drones)
        self.jobs: dict[str, PoolJob] = {}
        self._random = random.Random(seed)
        self._seen: list[int] = [0] * len(self.drones)

    def submit(self, job_id: str, duration_s: float, exit_code: int = 0) -> PoolJob:
        job = PoolJob(job_id, duration_s, exit_code)
        self.jobs[job_id] = job
        return job

    def _follow(self) -> None:
        """Update running jobs from what the drones recorded since the last look"""
        for index, drone in enumerate(self.drones):
            truth = drone.ground_truth()
            for entry in truth[self._seen[index] :]:
                job = self.jobs.get(str(entry.get("job_id")))
                if job is None or job.drone != index:
                    continue
                if entry["event"] == "payload_finished":
                    job.status, job.drone = "done", None
                elif entry["event"] == "payload_killed":
                    job.status, job.drone = "idle", None
                    job.evictions += 1
            self._seen[index] = len(truth)

    async def _offer(self, job: PoolJob, order: list[int]) -> None:
        for index in order:
            try:
                reply: dict[str, Any] = await self.drones[index].offer(
                    job.job_id, job.duration_s, exit_code=job.exit_code
                )
            except EmulatorUnavailable:
                continue  # that drone has ended
            outcome = reply.get("outcome")
            if outcome == "started":
                job.status, job.drone = "running", index
                job.starts += 1
                return
            if outcome == "held":
                job.status = "held"
                return
            if outcome in ("idle", "vacated"):
                job.refusals += 1

    async def negotiate(self) -> int:
        """One cycle: offer each idle job until a drone starts it; how many started"""
        self._follow()
        started = 0
        for job in [j for j in self.jobs.values() if j.status == "idle"]:
            order = list(range(len(self.drones)))
            self._random.shuffle(order)
            await self._offer(job, order)
            started += job.status == "running"
        return started

    def counts(self) -> dict[str, int]:
        self._follow()
        counts = {"idle": 0, "running": 0, "done": 0, "held": 0}
        for job in self.jobs.values():
            counts[job.status] += 1
        counts["evictions"] = sum(job.evictions for job in self.jobs.values())
        return counts

    async def run(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Negotiate every ``interval_s`` seconds until ``stop`` is set"""
        while not stop.is_set():
            await self.negotiate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
