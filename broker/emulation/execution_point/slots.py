"""What the emulated startd tracks: slots, the jobs claimed on them, a drain request"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any


@dataclasses.dataclass(eq=False)
class Job:
    """One offered job from the moment a slot is claimed for it"""

    job_id: str
    owner: str
    duration_s: float
    exit_code: int
    slot: Slot
    claimed_at: float
    number: int
    phase: str = "prepare"  #: prepare, running, exit_hook, done
    started_at: float | None = None
    started_mono: float | None = None  #: for run times, immune to clock steps
    kill_reason: str | None = None
    sleeper: asyncio.Task[None] | None = None
    hook: asyncio.subprocess.Process | None = None
    retire_timer: asyncio.TimerHandle | None = None
    #: more attributes of its job ad, e.g. the runtime it requests (``MaxWallTimeMins``)
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def cluster_proc(self) -> tuple[int, int]:
        cluster, _, proc = self.job_id.partition(".")
        try:
            return int(cluster), int(proc or 0)
        except ValueError:
            return self.number, 0


@dataclasses.dataclass(eq=False)
class Slot:
    name: str
    slot_id: int
    kind: str  #: Static, Partitionable, Dynamic
    cpus: int
    state: str = "Unclaimed"
    activity: str = "Idle"
    entered: float = dataclasses.field(default_factory=time.time)
    job: Job | None = None
    next_dynamic: int = 1

    def enter(self, state: str, activity: str) -> None:
        if (state, activity) != (self.state, self.activity):
            self.state, self.activity, self.entered = state, activity, time.time()


@dataclasses.dataclass
class Drain:
    request_id: str
    how: str
    on_completion: str
    reason: str
    start_expr: str | None
    started_at: float
