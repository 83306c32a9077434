"""
What really happened in one demonstration run, from the emulators' own records

Its rule: only records written independently of TARDIS's decisions and of the bus count,
and nothing after the run's end (the teardown).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.emulation.demo.demand import DEMAND_RECORD
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE
from broker.emulation.groundtruth import read_ground_truth


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


#: how each job of a real Slurm ended, by job id (``scontrol``'s ``JobState``), read after
#: the run by ``slurm_run.py``; absent for the emulated local batch system
SLURM_STATES = "slurm_states.json"
#: Slurm's states of a job that the batch system ended at the drone's end: its walltime
#: (``TIMEOUT``), a preemption, a deadline; the kill reason of what still ran
END_STATES = {
    "TIMEOUT": "the drone's end (walltime: Slurm's TIMEOUT)",
    "PREEMPTED": "the drone's end (preempted by the site)",
    "DEADLINE": "the drone's end (Slurm's deadline)",
}
#: the kill reason of what ran when the site preempted the drone (``job_preempted``)
PREEMPTED = END_STATES["PREEMPTED"]
#: the reason a startd gives a payload a fast drain stopped: a vacate, which HTCondor
#: queues again (the agent's drain at the drone's end or on a notice)
VACATED = "drain_fast"
#: the payload rows of a run whose drones have walltimes
KILLED_AT_END = "killed at the drone's end"
VACATED_ON_NOTICE = "vacated on notice"


def _site_jobs(root: Path, end: float) -> dict[str, dict[str, Any]]:
    """Each drone job of the local batch system, by job id, as its records until ``end`` say"""
    jobs: dict[str, dict[str, Any]] = {}
    states_file = root / SLURM_STATES
    states: dict[str, str] = json.loads(states_file.read_text()) if states_file.exists() else {}
    for entry in read_ground_truth(root / "lbs.jsonl"):
        if entry["t"] > end:
            continue
        job = jobs.setdefault(entry["job_id"], {"drone": entry.get("drone")})
        event = entry["event"]
        if event == "job_submitted":
            job["submitted"] = entry["t"]
        elif event == "job_started":
            job["started"] = entry["t"]
            job["sandbox"] = entry["sandbox"]
        elif event == "job_removed":
            job["removed"] = entry["t"]
            job["removed_was"] = entry["was"]
        elif event == "job_suspended":
            job.setdefault("suspended", entry["t"])
        elif event == "job_preempted":
            job["preempted"] = entry["t"]
        elif event == "job_exited":
            job["ended"] = entry["t"]
            job["exit_removed"] = bool(entry.get("removed"))
    for job_id, job in jobs.items():
        job["batch_state"] = states.get(job_id, "")
    return jobs


@dataclass
class _Tally:
    """The drones' and payloads' counts, one drone job at a time"""

    end: float
    payloads: Counter[str] = field(default_factory=Counter)
    kill_reasons: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    gate_refusals: int = 0
    drone_started: dict[str, float] = field(default_factory=dict)
    #: when each payload first started, by its job id
    payload_started: dict[str, float] = field(default_factory=dict)
    #: goodput: seconds each drone job was rented, payload seconds done and busy, drains done
    rented_s: float = 0.0
    done_s: float = 0.0
    busy_s: float = 0.0
    drained_at: dict[str, float] = field(default_factory=dict)

    def add_job(self, job: dict[str, Any]) -> None:
        started = job.get("started")
        if started is None:
            self.outcomes[
                "released before it started" if "removed" in job else "queued at the end"
            ] += 1
            return
        self.drone_started[job["drone"]] = started
        truth = Path(job["sandbox"]) / "ep" / GROUND_TRUTH_FILE
        running, killed_here = self._add_payloads(truth, job["drone"])
        ended = job.get("ended")
        gone = min(t for t in (ended, job.get("removed"), self.end) if t is not None)
        self.rented_s += max(0.0, gone - started)
        self.busy_s += sum(max(0.0, gone - t) for t in running.values())
        if ended is not None and running:
            self.payloads["killed"] += len(running)
            at_end = _end_of(job) if "removed" not in job else None
            if at_end is not None:  # the batch system's own kill, not TARDIS's removal
                self.payloads[KILLED_AT_END] += len(running)
            self.kill_reasons[at_end or "drone removed by the site (condor_rm)"] += len(running)
            killed_here += len(running)
        elif running:
            self.payloads["running at the end"] += len(running)
        self.outcomes[_outcome_of(job, killed_here)] += 1

    def _add_payloads(self, truth: Path, drone: str) -> tuple[dict[str, float], int]:
        """
        The payloads still running at the end of one startd's record (when each started),
        and how many it killed
        """
        running: dict[str, float] = {}
        killed = 0
        for entry in read_ground_truth(truth):
            if entry["t"] > self.end:
                continue
            event = entry["event"]
            if event == "payload_started":
                self.payloads["started"] += 1
                running[entry["job_id"]] = entry["t"]
                self.payload_started.setdefault(str(entry["job_id"]), entry["t"])
            elif event == "payload_finished":
                self.payloads["finished"] += 1
                self.done_s += entry.get("runtime_s", 0.0)
                self.busy_s += entry.get("runtime_s", 0.0)
                running.pop(entry["job_id"], None)
            elif event == "payload_killed" and entry.get("reason") == VACATED:
                self.payloads[VACATED_ON_NOTICE] += 1
                self.busy_s += entry.get("runtime_s", 0.0)
                running.pop(entry["job_id"], None)
            elif event == "payload_killed":
                self.payloads["killed"] += 1
                killed += 1
                self.kill_reasons[str(entry.get("reason"))] += 1
                self.busy_s += entry.get("runtime_s", 0.0)
                running.pop(entry["job_id"], None)
            elif event == "payload_refused":
                self.gate_refusals += 1
            elif event == "drain_completed":
                self.drained_at.setdefault(drone, entry["t"])
        return running, killed


def _end_of(job: dict[str, Any]) -> str | None:
    """The batch system's end of a drone job (preempted, its walltime), as a kill reason"""
    if "preempted" in job and job.get("ended", 0.0) >= job["preempted"]:
        return PREEMPTED
    return END_STATES.get(job["batch_state"])


def _outcome_of(job: dict[str, Any], killed_here: int) -> str:
    """How a drone job that started ended"""
    if "removed" in job:
        if killed_here:
            return "removed by the site with payloads running"
        return "removed by the site while idle"
    at_end = _end_of(job) if job.get("ended") is not None else None
    if at_end == PREEMPTED:
        return "preempted by the site"
    if at_end is not None:
        return "ended by the batch system at its walltime"
    if job.get("ended") is not None:
        return "ended by itself (drained)"
    return "running at the end"


def _tardis_view(root: Path, end: float) -> tuple[dict[str, float], Counter[str]]:
    """When TARDIS first saw each drone "Running", and how often it took each transition"""
    seen: dict[str, float] = {}
    transitions = Counter[str]()
    last_state: dict[str, str] = {}
    for entry in read_ground_truth(root / "tardis.jsonl"):
        if entry["t"] > end:
            continue
        drone, state = entry["drone"], entry["state"]
        previous = last_state.get(drone)
        if previous is not None:
            transitions[f"{previous.removesuffix('State')}->{state.removesuffix('State')}"] += 1
        last_state[drone] = state
        if entry.get("resource_status") == "Running" and drone not in seen:
            seen[drone] = entry["t"]
    return seen, transitions


def _latency(drone_started: dict[str, float], seen: dict[str, float]) -> dict[str, Any]:
    """How long after a drone started TARDIS saw it running"""
    latencies = [
        seen[drone] - started
        for drone, started in drone_started.items()
        if drone in seen and seen[drone] >= started
    ]
    never_seen = sum(1 for drone in drone_started if drone not in seen)
    latency: dict[str, Any] = {"drones": len(latencies), "never_seen_running": never_seen}
    if latencies:
        latency.update(
            median_s=round(statistics.median(latencies), 2),
            p90_s=round(_percentile(latencies, 0.9), 2),
            max_s=round(max(latencies), 2),
        )
    return latency


def _tardis_down(root: Path, end: float) -> dict[str, float]:
    """When TARDIS let each drone go (its ``DownState``)"""
    return {
        entry["drone"]: entry["t"]
        for entry in read_ground_truth(root / "tardis.jsonl")
        if entry["t"] <= end and entry["state"] == "DownState"
    }


def _goodput(tally: _Tally, down: dict[str, float], cores: float) -> dict[str, Any]:
    """
    Core-seconds of payloads completed, rented while idle (booting, idle, draining, drained
    but not yet ended), payloads completed per drone-hour, and drained drones' wait for TARDIS
    """
    waits = [
        down.get(drone, tally.end) - drained
        for drone, drained in tally.drained_at.items()
        if down.get(drone, tally.end) >= drained
    ]
    hours = tally.rented_s / 3600
    goodput: dict[str, Any] = {
        "core-s rented": round(tally.rented_s * cores, 1),
        "payload core-s completed": round(tally.done_s, 1),
        "core-s rented while idle": round(tally.rented_s * cores - tally.busy_s, 1),
        "payloads completed per drone-hour": (
            round(tally.payloads["finished"] / hours, 1) if hours else 0.0
        ),
        "drained drones": len(waits),
    }
    if waits:
        goodput["drained -> TARDIS Down (s, median/max)"] = (
            f"{statistics.median(waits):.1f} / {max(waits):.1f}"
        )
    return goodput


class Queue:
    """
    The overlay pool's queue over time: each payload waits from its submission
    (``obs.jsonl``'s ``payload_submitted``) until it first started (its startd's record)
    """

    def __init__(self, submitted: dict[str, float], started: dict[str, float]) -> None:
        self.submitted, self.started = submitted, started
        changes = sorted(
            [(t, 1) for t in submitted.values()]
            + [(started[job], -1) for job in submitted if job in started]
        )
        self._times = [t for t, _ in changes]
        self._lengths = list(itertools.accumulate(step for _, step in changes))

    def length(self, at: float) -> int:
        """Payloads submitted and not yet started at ``at`` (epoch seconds)"""
        index = bisect.bisect_right(self._times, at)
        return self._lengths[index - 1] if index else 0

    def waits(self, end: float) -> list[float]:
        """Each payload's wait; one not started by ``end`` counts its wait until then"""
        return [self.started.get(job, end) - t for job, t in self.submitted.items()]


def _submitted(root: Path, end: float) -> dict[str, float]:
    """When each payload was submitted to the overlay pool, by job id"""
    return {
        str(entry["job_id"]): entry["t"]
        for entry in read_ground_truth(root / "obs.jsonl")
        if entry["event"] == "payload_submitted" and entry["t"] <= end
    }


def _queue_rows(queue: Queue, end: float) -> dict[str, Any]:
    """The queue's rows: payloads submitted, still queued at the end, their waits"""
    waits = queue.waits(end)
    rows: dict[str, Any] = {
        "submitted": len(queue.submitted),
        "queued at the end": sum(1 for job in queue.submitted if job not in queue.started),
    }
    if waits:
        rows["wait_s"] = {
            "median": round(statistics.median(waits), 2),
            "p90": round(_percentile(waits, 0.9), 2),
            "mean": round(statistics.fmean(waits), 2),
        }
    return rows


#: a release counts as followed by a demand rise within this many controller intervals
#: (10 s of the demo at its interval of 1/30 s: five minutes at a site's time scale)
RISE_WINDOW_INTERVALS = 300

#: TARDIS's states before it first sees a drone available: a drone released in one of
#: them is released while booting (``None``: created, its state machine not yet run)
BOOTING_STATES = frozenset(
    {"None", "RequestState", "BootingState", "IntegrateState", "IntegratingState"}
)


def _controller_rows(
    records: list[dict[str, Any]],
    queue: Queue,
    site_started: dict[str, float],
    interval_s: float,
) -> dict[str, Any]:
    """
    What COBalD's controller and pool did while payloads waited, from the
    ``DemandRecorder``'s records (``demand.py``)

    :param site_started: when each drone's job started at the site, by drone
    :param interval_s: the controller's interval
    """
    demands = [r for r in records if r["event"] == "demand"]
    lowering = [r for r in demands if r["value"] < r["was"]]
    lowered_queued = [r for r in lowering if queue.length(r["t"]) > 0]
    releases = [r for r in records if r["event"] == "release"]
    spawns = [r["t"] for r in records if r["event"] == "spawn"]
    window_s = RISE_WINDOW_INTERVALS * interval_s

    def level(at: float) -> float:
        before = [r["value"] for r in demands if r["t"] <= at]
        return float(before[-1]) if before else 0.0

    def rose_after(at: float) -> bool:
        then = level(at)
        return any(at < r["t"] <= at + window_s and r["value"] > then for r in demands)

    booting_queued = [
        r for r in releases if r["state"] in BOOTING_STATES and queue.length(r["t"]) > 0
    ]
    window = f"within {RISE_WINDOW_INTERVALS} intervals ({window_s:g} s)"
    return {
        "demand-lowering steps": len(lowering),
        "demand-lowering steps while payloads were queued": len(lowered_queued),
        "cores of demand lowered while payloads were queued": round(
            sum(r["was"] - r["value"] for r in lowered_queued), 1
        ),
        "demand (cores, max)": round(max((r["value"] for r in demands), default=0.0), 1),
        "drones released by the pool": len(releases),
        f"releases followed by a demand rise {window}": sum(
            1 for r in releases if rose_after(r["t"])
        ),
        f"releases followed by a new drone {window}": sum(
            1 for r in releases if any(r["t"] < t <= r["t"] + window_s for t in spawns)
        ),
        "releases of booting drones while payloads were queued": len(booting_queued),
        "of them already running at the site": sum(
            1 for r in booting_queued if site_started.get(r["drone"], math.inf) <= r["t"]
        ),
    }


def analyze(
    root: Path,
    end: float,
    cores_per_drone: float = 1.0,
    controller_interval_s: float | None = None,
    end_rows: bool = False,
) -> dict[str, Any]:
    """
    The numbers of one run whose files are under ``root``

    Sources: the local batch system's ground truth (``lbs.jsonl``: when each drone job was
    submitted, started, suspended, removed, ended); each drone's emulated startd
    (``jobs/<id>/ep/ground_truth.jsonl``: every payload start, end and kill); TARDIS's own
    state transitions (``tardis.jsonl``, by ``broker.emulation.demo.recorder``: what TARDIS
    *saw*). A payload that started and has no end while its drone's processes are gone was
    killed with the drone (the site's ``condor_rm`` leaves the startd no time to write anything).

    :param end: epoch seconds when the run ended (later records are teardown)
    :param cores_per_drone: cores each drone job rents (one slot per core)
    :param controller_interval_s: the interval of COBalD's controller, for a run whose demand
        it set: adds the rows of the queue (``obs.jsonl``'s submissions) and of the
        controller (``demand.jsonl``, by ``broker.emulation.demo.demand.DemandRecorder``)
    :param end_rows: add the rows of a run whose drones have walltimes: payloads killed at
        the drone's end (what ran when Slurm ended a job no ``scancel`` removed:
        ``TIMEOUT``, a preemption; :data:`SLURM_STATES`) and payloads vacated (the
        agent's fast drain at the drone's end or on a notice, not counted as killed)
    """
    jobs = _site_jobs(root, end)
    tally = _Tally(end)
    for job in jobs.values():
        tally.add_job(job)
    # what TARDIS saw: the first transition taken while it held "Running"
    seen, transitions = _tardis_view(root, end)
    payloads, outcomes = tally.payloads, tally.outcomes
    result: dict[str, Any] = {
        "drones": {
            "requested": sum(1 for job in jobs.values() if "submitted" in job),
            "started": len(tally.drone_started),
            **{key: outcomes[key] for key in sorted(outcomes)},
        },
        "payloads": {
            "started": payloads["started"],
            "finished": payloads["finished"],
            "killed": payloads["killed"],
            "running at the end": payloads["running at the end"],
            "refused at the gate": tally.gate_refusals,
            **(
                {key: payloads[key] for key in (KILLED_AT_END, VACATED_ON_NOTICE)}
                if end_rows
                else {}
            ),
        },
        "goodput": _goodput(tally, _tardis_down(root, end), cores_per_drone),
        "kill_reasons": dict(tally.kill_reasons),
        "tardis_latency": _latency(tally.drone_started, seen),
        "tardis_transitions": dict(sorted(transitions.items())),
    }
    if controller_interval_s is not None:
        queue = Queue(_submitted(root, end), tally.payload_started)
        records = [r for r in read_ground_truth(root / DEMAND_RECORD) if r["t"] <= end]
        site_started = {job["drone"]: job["started"] for job in jobs.values() if "started" in job}
        result["queue"] = _queue_rows(queue, end)
        result["controller"] = _controller_rows(records, queue, site_started, controller_interval_s)
    return result
