"""
An emulated overlay batch system (OBS): collector, negotiator and a queue of payloads

Its one rule: a payload a startd does not start goes back to the front of the
queue and is offered again. Its socket answers ``status`` (one ad per startd)
and ``drain`` (``drone``), as ``condor_status`` and ``condor_drain`` would.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.execution_point.control import EmulatorControl
from broker.emulation.groundtruth import GroundTruth
from broker.emulation.service import Service

log = logging.getLogger("emulation.overlay")


@dataclasses.dataclass(eq=False)
class Machine:
    drone: str
    control: EmulatorControl
    ad: dict[str, Any] | None = None
    cycling: bool = False
    gone: bool = False
    seen: int = 0  #: ground-truth entries of the startd already followed


@dataclasses.dataclass(eq=False)
class PoolJob:
    """A payload of the queue"""

    job_id: str
    duration_s: float
    exit_code: int = 0
    status: str = "idle"  #: idle, running, done, killed
    drone: str | None = None  #: the drone running it
    starts: int = 0
    refusals: int = 0


class OverlayPool:
    """
    :param workdir: where the socket lives
    :param payload_duration: seconds the ``n``-th payload (from 0) runs, for an endless
        supply of payloads behind the submitted ones; ``None``: only the submitted ones
    :param truth: the ground-truth file of submissions, offers and their outcomes (``None``: none)
    :param cycle_s: seconds between negotiation cycles
    :param ad: more job ad attributes of each payload, e.g. the runtime it requests
    """

    def __init__(
        self,
        workdir: Path,
        payload_duration: Callable[[int], float] | None,
        truth: GroundTruth | None,
        *,
        cycle_s: float = 0.5,
        ad: Callable[[PoolJob], Mapping[str, Any]] | None = None,
    ) -> None:
        self.workdir = workdir
        self.socket = workdir / "obs.sock"
        self.payload_duration = payload_duration
        self.truth = truth
        self.cycle_s = cycle_s
        self.ad = ad
        self.machines: dict[str, Machine] = {}
        self.jobs: dict[str, PoolJob] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self._idle: collections.deque[PoolJob] = collections.deque()
        self._next = 0
        self._service = Service(self.socket, self.handle)

    def join(self, drone: str, state_dir: Path) -> None:
        """A drone job started: its startd will appear (the LBS calls this)"""
        self.machines[drone] = Machine(drone, EmulatorControl(state_dir))

    def submit(self, job_id: str, duration_s: float, exit_code: int = 0) -> PoolJob:
        """Queue a payload (behind the idle ones); the ground truth's ``payload_submitted``"""
        job = PoolJob(job_id, duration_s, exit_code)
        self.jobs[job_id] = job
        self._idle.append(job)
        if self.truth is not None:
            self.truth.record("payload_submitted", job_id=job_id, duration_s=duration_s)
        return job

    @property
    def idle(self) -> int:
        """Payloads waiting in the queue (those being offered not among them)"""
        return len(self._idle)

    def leave(self, drone: str) -> None:
        """A drone job ended: its startd is gone"""
        machine = self.machines.get(drone)
        if machine is not None:
            machine.gone = True
            machine.ad = None

    async def start(self) -> None:
        await self._service.start(self._negotiate)

    async def close(self) -> None:
        await self._service.close()

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {
                "ok": True,
                "machines": {
                    drone: machine.ad
                    for drone, machine in self.machines.items()
                    if machine.ad is not None
                },
            }
        if op == "drain":
            machine = self.machines.get(str(request.get("drone")))
            if machine is None or machine.gone:
                return {"ok": False, "error": "no such startd"}
            try:
                reply = await machine.control.request(
                    "drain",
                    how="graceful",
                    on_completion="nothing",
                    reason=str(request.get("reason") or "TARDIS"),
                    timeout_s=10,
                )
            except EmulatorUnavailable as err:
                return {"ok": False, "error": str(err)}
            self.counts["drains"] += 1
            return reply
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ------------------------------------------------------------ negotiation

    def _payload(self) -> PoolJob | None:
        if self._idle:
            return self._idle.popleft()
        if self.payload_duration is None:
            return None
        index = self._next
        self._next += 1
        job = PoolJob(f"{index + 1}.0", float(self.payload_duration(index)))
        self.jobs[job.job_id] = job
        return job

    def _cycles(self) -> list[Coroutine[Any, Any, None]]:
        """A negotiation cycle with each startd that is not in one"""
        ready = [m for m in self.machines.values() if not m.gone and not m.cycling]
        for machine in ready:
            machine.cycling = True
        return [self._cycle(machine) for machine in ready]

    async def _negotiate(self) -> None:
        while True:
            for cycle in self._cycles():
                self._service.tasks.spawn(cycle)
            await asyncio.sleep(self.cycle_s)

    async def negotiate(self) -> None:
        """One negotiation cycle with every startd, waited for (without :meth:`start`)"""
        await asyncio.gather(*self._cycles())

    async def _cycle(self, machine: Machine) -> None:
        try:
            with contextlib.suppress(EmulatorUnavailable):
                await self._match(machine)
        except Exception:
            log.exception("negotiation with %s failed", machine.drone)
        finally:
            machine.cycling = False

    async def _match(self, machine: Machine) -> None:
        status = await machine.control.request("status", timeout_s=10)
        if machine.gone:
            return
        machine.ad = _ad(status)
        if machine.ad is None or status.get("draining") or status.get("shutting_down"):
            return
        free = [s for s in status.get("slots", []) if s.get("state") == "Unclaimed"]
        for _ in free:
            job = self._payload()
            if job is None:
                return
            try:
                reply = await machine.control.offer(
                    job.job_id,
                    job.duration_s,
                    exit_code=job.exit_code,
                    attributes=dict(self.ad(job)) if self.ad is not None else None,
                    timeout_s=60,
                )
            except EmulatorUnavailable:
                self._idle.appendleft(job)
                raise
            outcome = str(reply.get("outcome", "rejected"))
            self.counts[f"offer_{outcome}"] += 1
            if self.truth is not None:
                self.truth.record(
                    "offer",
                    job_id=job.job_id,
                    drone=machine.drone,
                    outcome=outcome,
                    reason=reply.get("reason") or reply.get("message") or "",
                )
            if outcome != "started":
                job.refusals += 1
                self._idle.appendleft(job)
                return  # the startd does not take work now; try again next cycle
            job.status, job.drone = "running", machine.drone
            job.starts += 1

    # ------------------------------------------------------------ job states

    def job_states(self) -> collections.Counter[str]:
        """How many payloads are idle, running, done and killed (from the startds' ground truth)"""
        for machine in self.machines.values():
            truth = machine.control.ground_truth()
            for entry in truth[machine.seen :]:
                job = self.jobs.get(str(entry.get("job_id")))
                if job is None or job.status != "running" or job.drone != machine.drone:
                    continue
                if entry.get("event") == "payload_finished":
                    job.status = "done"
                elif entry.get("event") == "payload_killed":
                    job.status = "killed"
            machine.seen = len(truth)
        return collections.Counter(job.status for job in self.jobs.values())


def _ad(status: dict[str, Any]) -> dict[str, Any] | None:
    """The collector's ad of a startd: what ``condor_status`` shows of it"""
    if not status.get("ok") or not status.get("startd_running"):
        return None
    slots = status.get("slots", [])
    busy = sum(1 for slot in slots if slot.get("job_id"))
    if status.get("draining"):
        state, activity = ("Drained", "Retiring") if busy else ("Drained", "Idle")
    else:
        state, activity = "Unclaimed", "Idle"
    return {
        "State": state,
        "Activity": activity,
        "slots": len(slots),
        "busy": busy,
        "updated": time.time(),
    }
