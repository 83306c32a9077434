"""A plain fake of the agent behind the gate socket, for the gate and hook tests"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

from remote_agent.gate.server import GateServer
from remote_agent.interfaces import GATE_CLOSED_STATUS, GateDecision, JobStart
from remote_agent.protocol.events import PayloadEnd


class FakeAgent:
    """A GateHandler that records what it is asked and answers from a flag"""

    def __init__(self) -> None:
        self.open = True
        self.status_code = GATE_CLOSED_STATUS
        self.started: list[JobStart] = []
        self.exited: list[tuple[str, PayloadEnd, int | None, float | None]] = []
        self.threads: set[int] = set()
        self.fail = False

    def prepare_job(self, job: JobStart) -> GateDecision:
        self.threads.add(threading.get_ident())
        if self.fail:
            raise RuntimeError("bookkeeping broke")
        self.started.append(job)
        if self.open:
            return GateDecision(allow=True)
        return GateDecision(allow=False, status_code=self.status_code, message="drone is draining")

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        self.threads.add(threading.get_ident())
        self.exited.append((job_id, how, exit_code, duration_s))

    async def settled(self) -> None:
        return None


#: starts a gate socket served by a fresh :class:`FakeAgent`; options go to ``GateServer``
GateFactory = Callable[..., Awaitable[tuple[GateServer, FakeAgent]]]
