"""
An emulated overlay batch system (OBS): collector, negotiator and a queue of payloads

Every drone's emulated startd (``startd.py``) joins it when its drone job
starts. Every ``cycle_s`` it reads each startd's state (the collector's view)
and offers idle payloads to free slots (the negotiator and the payloads'
schedd): there are always payloads waiting, so a drone gets work as soon as
its startd accepts it, as in the report. A payload the startd refuses (START
false, PREPARE_JOB refused) goes back to the queue and is offered again.

The emulated TARDIS batch-system adapter (``tardis_adapters.py``) asks it
over its socket, like ``condor_status`` and ``condor_drain``:

* ``status``: one ad per startd it knows: ``State``, ``Activity``, ``slots``, ``busy``;
* ``drain`` (``drone``): ``condor_drain -graceful`` of that drone's startd.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.execution_point.control import EmulatorControl
from broker.emulation.groundtruth import GroundTruth
from broker.emulation.rpc import serve

log = logging.getLogger("emulation.overlay")


@dataclasses.dataclass(eq=False)
class Machine:
    drone: str
    control: EmulatorControl
    ad: dict[str, Any] | None = None
    cycling: bool = False
    gone: bool = False


class OverlayPool:
    """
    :param workdir: where the socket lives
    :param payload_duration: seconds the ``n``-th payload (from 0) runs
    :param truth: the ground-truth file (offers and their outcomes)
    :param cycle_s: seconds between negotiation cycles
    """

    def __init__(
        self,
        workdir: Path,
        payload_duration: Callable[[int], float],
        truth: GroundTruth,
        *,
        cycle_s: float = 0.5,
    ) -> None:
        self.workdir = workdir
        self.socket = workdir / "obs.sock"
        self.payload_duration = payload_duration
        self.truth = truth
        self.cycle_s = cycle_s
        self.machines: dict[str, Machine] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self._idle: collections.deque[tuple[str, float]] = collections.deque()
        self._next = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def join(self, drone: str, state_dir: Path) -> None:
        """A drone job started: its startd will appear (the LBS calls this)"""
        self.machines[drone] = Machine(drone, EmulatorControl(state_dir))

    def leave(self, drone: str) -> None:
        """A drone job ended: its startd is gone"""
        machine = self.machines.get(drone)
        if machine is not None:
            machine.gone = True
            machine.ad = None

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._server = await serve(self.socket, self.handle)
        self._spawn(self._negotiate())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    def _payload(self) -> tuple[str, float]:
        if self._idle:
            return self._idle.popleft()
        index = self._next
        self._next += 1
        return f"{index + 1}.0", float(self.payload_duration(index))

    async def _negotiate(self) -> None:
        while True:
            for machine in list(self.machines.values()):
                if not machine.gone and not machine.cycling:
                    machine.cycling = True
                    self._spawn(self._cycle(machine))
            await asyncio.sleep(self.cycle_s)

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
            job_id, duration = self._payload()
            try:
                reply = await machine.control.offer(job_id, duration, timeout_s=60)
            except EmulatorUnavailable:
                self._idle.appendleft((job_id, duration))
                raise
            outcome = str(reply.get("outcome", "rejected"))
            self.counts[f"offer_{outcome}"] += 1
            self.truth.record(
                "offer",
                job_id=job_id,
                drone=machine.drone,
                outcome=outcome,
                reason=reply.get("reason") or reply.get("message") or "",
            )
            if outcome != "started":
                self._idle.appendleft((job_id, duration))
                return  # the startd does not take work now; try again next cycle


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
