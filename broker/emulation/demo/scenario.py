"""
The demonstration's scenario: everything random about it, drawn from one seed

Its rule: the same seed gives the same demand swings, queue delays and payload durations
in the stock run and in the run with cobald-remote, so the two can be compared.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any


@dataclasses.dataclass(frozen=True)
class Scenario:
    """
    :param seed: the seed of every random choice
    :param duration_s: seconds of swinging demand
    :param cooldown_s: seconds of zero demand after it, for drones to wind down
    :param max_drones: most drones demanded at once
    :param slots: slots (cores) per drone; a drone's demand in COBalD
    :param heartbeat_s: TARDIS's ``drone_heartbeat_interval`` (whole seconds)
    :param pool_interval_s: how often COBalD's pool adjusts its drones
    :param site_max_age_s: age of the site's cached job listing (``condor_q``)
    :param batch_max_age_s: age of the overlay pool's cached listing (``condor_status``)
    :param queue_delay_s: range of a drone job's wait in the site's queue
    :param payload_s: range of a payload's duration
    :param base_s: range of the length of a phase of low (base) demand
    :param spike_s: range of the length of a spike of high demand
    :param trough_s: range of the length of a trough of (almost) no demand
    :param first_base_s: length of the first base phase (default: drawn like the others)
    :param vacate_s: seconds between SIGTERM and SIGKILL when the site removes a job
    :param lost_after_s: cobald-remote: silence after which an agent counts as lost
    :param scale_down_window_s: cobald-remote: the pools' scale-down stabilization window
        (the default's 300 s at TARDIS's 60 s heartbeat, scaled to the demo's heartbeat)
    :param agent_heartbeat_s: the agents' heartbeat interval
    :param agent_poll_s: how often agents poll their startd (``condor_who``)
    :param tardis_adapters: ``emulated``: the demo's polled adapters
        (``tardis_adapters.py``; the site view cached for ``site_max_age_s``);
        ``htcondor``: TARDIS's own HTCondor adapters against fake ``condor_*`` tools
        (``schedd.py``, ``collector.py``; ``condor_q`` fresh every heartbeat,
        ``condor_status`` cached for ``batch_max_age_s``); ``slurm``: TARDIS's Slurm site
        adapter against a real single-node Slurm (``squeue`` every heartbeat; no seeded
        queue delay: Slurm schedules) and TARDIS's HTCondor batch-system adapter as above
    """

    seed: int = 1
    duration_s: float = 80.0
    cooldown_s: float = 30.0
    max_drones: int = 5
    slots: int = 2
    heartbeat_s: int = 2
    pool_interval_s: float = 1.0
    site_max_age_s: float = 10.0
    batch_max_age_s: float = 10.0
    queue_delay_s: tuple[float, float] = (1.0, 10.0)
    payload_s: tuple[float, float] = (4.0, 14.0)
    base_s: tuple[float, float] = (10.0, 16.0)
    spike_s: tuple[float, float] = (5.0, 10.0)
    trough_s: tuple[float, float] = (4.0, 8.0)
    first_base_s: float | None = None
    vacate_s: float = 1.0
    lost_after_s: float = 10.0
    scale_down_window_s: float = 10.0
    agent_heartbeat_s: float = 2.0
    agent_poll_s: float = 2.0
    tardis_adapters: str = "emulated"

    @property
    def total_s(self) -> float:
        return self.duration_s + self.cooldown_s

    def schedule(self) -> list[tuple[float, float]]:
        """
        ``[seconds after start, demand in cores]``: base, spike, trough, again and again

        A spike asks for many drones; the trough after it comes while some of
        them have started but TARDIS, polling, still sees them queued: the
        conditions of the report. The base keeps drones established, so that
        COBalD's pool has supply to shrink when demand falls into the trough
        (``FactoryPool`` shrinks only while supply exceeds demand, and then
        releases the booting drones first).
        """
        rng = random.Random(f"{self.seed}:demand")
        steps: list[tuple[float, float]] = []
        at = 0.0
        top = self.max_drones
        first = True
        while at < self.duration_s:
            base_s = self.base_s
            if first and self.first_base_s is not None:
                base_s = (self.first_base_s, self.first_base_s)
            first = False
            for low, high, length in (
                (min(2, top), max(2, top // 2), base_s),
                (max(1, top - 1), top, self.spike_s),
                (0, max(0, min(1, top // 3)), self.trough_s),
            ):
                if at >= self.duration_s:
                    break
                steps.append((round(at, 1), float(rng.randint(low, high) * self.slots)))
                at += rng.uniform(*length)
        steps.append((self.duration_s, 0.0))
        return steps

    def queue_delay(self, index: int) -> float:
        """Seconds the ``index``-th drone job (from 0) waits in the site's queue"""
        return round(random.Random(f"{self.seed}:queue:{index}").uniform(*self.queue_delay_s), 2)

    def payload_duration(self, index: int) -> float:
        """Seconds the ``index``-th payload (from 0) runs"""
        return round(random.Random(f"{self.seed}:payload:{index}").uniform(*self.payload_s), 2)

    def describe(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["schedule"] = self.schedule()
        return values
