"""
The demonstration's scenario: everything random about it, drawn from one seed

Its rule: the same seed gives the same demand swings, payload arrivals, queue delays and
payload durations in the stock run and in the run with cobald-remote, so the two can be
compared.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any

from broker.tardis.batch import DEFAULT_UTILISATION_HOLD_S
from broker.tardis.pool import DEFAULT_DRONE_START_S, DEFAULT_SCALE_DOWN_WINDOW_S

#: how the demo's demand is made (:class:`Scenario`'s ``demand``)
DEMANDS = ("scripted", "controller")

#: how many times faster than at a site the demo runs: TARDIS's heartbeat 60 s -> 2 s,
#: COBalD's pool interval 30 s -> 1 s
TIME_SCALE = 30


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
    :param utilisation_hold_s: cobald-remote: how long a freed slot counts as busy (the
        default's 60 s, scaled alike)
    :param agent_heartbeat_s: the agents' heartbeat interval
    :param agent_poll_s: how often agents poll their startd (``condor_who``)
    :param demand: ``scripted``: COBalD's demand follows :meth:`schedule` and the overlay
        pool has an endless supply of payloads; ``controller``: COBalD's own
        ``LinearController`` and ``Limiter`` set the demand from the pool's utilisation and
        allocation, as at a site, and payloads arrive as :meth:`arrivals` says
    :param controller_rate: ``controller``: the ``LinearController``'s rate, cores per
        second: TARDIS's example, 1, unscaled, because the pool is smaller by about as much
        as time is faster (10 cores against a site's few hundred)
    :param controller_interval_s: ``controller``: the ``LinearController``'s interval,
        COBalD's default 1 s divided by :data:`TIME_SCALE`
    :param tardis_adapters: ``emulated``: the demo's polled adapters
        (``tardis_adapters.py``; the site view cached for ``site_max_age_s``);
        ``htcondor``: TARDIS's own HTCondor adapters against fake ``condor_*`` tools
        (``schedd.py``, ``collector.py``; ``condor_q`` fresh every heartbeat,
        ``condor_status`` cached for ``batch_max_age_s``); ``slurm``: TARDIS's Slurm site
        adapter against a real single-node Slurm (``squeue`` every heartbeat; no seeded
        queue delay: Slurm schedules) and TARDIS's HTCondor batch-system adapter as above
    :param walltime_s: ``slurm``: each drone job's walltime, a whole number of minutes in
        seconds (Slurm counts minutes; TARDIS's ``Walltime``); each payload's job ad then
        asks for the longest payload duration (``AllowedJobDuration``). ``None``: an hour
    :param drone_start_s: cobald-remote, where drones end: ``bus.drone_start_s`` (its
        default scaled by :data:`TIME_SCALE`: 20 s)
    :param preemptions: ``slurm``: how many running drone jobs the site preempts during the
        swinging demand, at :meth:`preemption_times`
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
    scale_down_window_s: float = DEFAULT_SCALE_DOWN_WINDOW_S / TIME_SCALE
    utilisation_hold_s: float = DEFAULT_UTILISATION_HOLD_S / TIME_SCALE
    agent_heartbeat_s: float = 2.0
    agent_poll_s: float = 2.0
    demand: str = "controller"
    controller_rate: float = 1.0
    controller_interval_s: float = 1.0 / TIME_SCALE
    tardis_adapters: str = "emulated"
    walltime_s: float | None = None
    drone_start_s: float = DEFAULT_DRONE_START_S / TIME_SCALE
    preemptions: int = 0

    def __post_init__(self) -> None:
        if self.demand not in DEMANDS:
            raise ValueError(f"demand must be one of {', '.join(DEMANDS)}, not {self.demand!r}")
        if self.preemptions and self.tardis_adapters != "slurm":
            raise ValueError("preemptions need the real Slurm (--tardis-adapters slurm)")
        if self.preemptions < 0:
            raise ValueError(f"preemptions must be >= 0, not {self.preemptions}")
        if self.walltime_s is not None:
            if self.tardis_adapters != "slurm":
                raise ValueError("a walltime needs the real Slurm (--tardis-adapters slurm)")
            if self.walltime_s <= 0 or self.walltime_s % 60:
                raise ValueError(
                    f"a walltime is a whole number of minutes > 0 (Slurm counts minutes), "
                    f"in seconds, not {self.walltime_s:g}"
                )

    @property
    def walltime_min(self) -> int:
        """The drone jobs' walltime in minutes, as TARDIS's Slurm adapter passes it"""
        return 60 if self.walltime_s is None else int(self.walltime_s // 60)

    def preemption_times(self) -> list[float]:
        """
        Seconds after the start at which the site preempts a running drone job: spread
        evenly over the swinging demand after its first 10 s, each moved by up to a third of
        the spacing (seeded)
        """
        if not self.preemptions:
            return []
        rng = random.Random(f"{self.seed}:preemptions")
        spacing = max(0.0, self.duration_s - 10.0) / self.preemptions
        return [
            round(10.0 + spacing * (i + 0.5) + rng.uniform(-spacing / 3, spacing / 3), 1)
            for i in range(self.preemptions)
        ]

    @property
    def drones_end(self) -> bool:
        """Whether the site ends drone jobs of its own: at a walltime, by preemptions"""
        return self.walltime_s is not None or self.preemptions > 0

    def payload_ad(self) -> dict[str, Any]:
        """More job ad of each payload: where drones end, the runtime it asks for"""
        if not self.drones_end:
            return {}
        return {"AllowedJobDuration": math.ceil(self.payload_s[1])}

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

    def arrivals(self) -> list[tuple[float, float]]:
        """
        ``[seconds after start, duration]`` of each payload submitted to the overlay pool

        The swings of :meth:`schedule`, as work: during each step payloads arrive as a
        Poisson process whose rate keeps the step's demand in cores busy on average
        (the demand divided by the mean payload duration; Little's law), none after
        ``duration_s``. The ``n``-th payload (from 0) runs :meth:`payload_duration` ``(n)``.
        """
        rng = random.Random(f"{self.seed}:arrivals")
        mean_s = sum(self.payload_s) / 2
        steps = self.schedule()
        arrivals: list[tuple[float, float]] = []
        for (at, cores), (until, _) in itertools.pairwise(steps):
            rate = cores / mean_s  # payloads per second
            t = at
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= until:
                    break
                arrivals.append((round(t, 2), self.payload_duration(len(arrivals))))
        return arrivals

    def queue_delay(self, index: int) -> float:
        """Seconds the ``index``-th drone job (from 0) waits in the site's queue"""
        return round(random.Random(f"{self.seed}:queue:{index}").uniform(*self.queue_delay_s), 2)

    def payload_duration(self, index: int) -> float:
        """Seconds the ``index``-th payload (from 0) runs"""
        return round(random.Random(f"{self.seed}:payload:{index}").uniform(*self.payload_s), 2)

    def describe(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["schedule"] = self.schedule()
        if self.demand == "controller":
            values["arrivals"] = self.arrivals()
        return values
