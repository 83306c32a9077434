"""The emulated master's and startd's state (no I/O but the ground truth)"""

from __future__ import annotations

import asyncio
import os
import time

from broker.emulation.execution_point.classad import Ad
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE, control_socket_path
from broker.emulation.execution_point.settings import Settings
from broker.emulation.execution_point.slots import Drain, Slot
from broker.emulation.groundtruth import GroundTruth
from broker.emulation.service import Tasks


class StartdState:
    """The emulated master's and startd's state, and starting and stopping the startd"""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.truth = GroundTruth(settings.state_dir / GROUND_TRUTH_FILE)
        self.control_path = control_socket_path(settings.state_dir)
        self.pid = os.getpid()
        self.master_started = time.time()
        self.startd_running = False
        self.startd_ready = False
        self.startd_held = False  #: exited on drain completion; the master does not restart it
        self.startd_generation = 0
        self.startd_start_time = 0.0
        self.extras = Ad()
        self.slots: list[Slot] = []
        self.drain: Drain | None = None
        self.drain_requests = 0
        self.shutting_down: str | None = None
        self.jobs = 0
        self._exit: asyncio.Future[tuple[int, str]] | None = None
        self._tasks = Tasks()
        self._no_jobs = asyncio.Event()  #: set whenever a job leaves its slot

    @property
    def startd_pid(self) -> int:
        return self.pid + self.startd_generation if self.startd_running else 0

    async def _start_startd(self) -> None:
        await asyncio.sleep(self.settings.startd_start_delay_s)
        if self.shutting_down:
            return
        self.startd_generation += 1
        self.startd_running, self.startd_held = True, False
        self.startd_start_time = time.time()
        self.extras = Ad()  # the machine ad extras do not survive a startd restart
        self.drain = None
        self._make_slots()
        self.startd_ready = True
        self.truth.record("startd_ready", startd_pid=self.startd_pid)

    def _make_slots(self) -> None:
        name = self.settings.startd_name
        if self.settings.partitionable:
            self.slots = [Slot(f"slot1@{name}", 1, "Partitionable", self.settings.cpus)]
        else:
            self.slots = [
                Slot(f"slot{i}@{name}", i, "Static", 1) for i in range(1, self.settings.cpus + 1)
            ]

    def _stop_startd(self, why: str, *, held: bool) -> None:
        self.startd_running = self.startd_ready = False
        self.startd_held = held
        self.startd_start_time = 0.0
        self.slots = []
        self.truth.record("startd_exited", why=why)
