"""
What really happened in one demonstration run, from the emulators' own records

Its rule: only records written independently of TARDIS's decisions and of the bus count,
and nothing after the run's end (the teardown).
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE
from broker.emulation.groundtruth import read_ground_truth


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


def analyze(root: Path, end: float) -> dict[str, Any]:
    """
    The numbers of one run whose files are under ``root``

    Sources: the local batch system's ground truth (``lbs.jsonl``: when each drone job was
    submitted, started, suspended, removed, ended); each drone's emulated startd
    (``jobs/<id>/ep/ground_truth.jsonl``: every payload start, end and kill); TARDIS's own
    state transitions (``tardis.jsonl``, by ``broker.emulation.demo.recorder``: what TARDIS
    *saw*). A payload that started and has no end while its drone's processes are gone was
    killed with the drone (the site's ``condor_rm`` leaves the startd no time to write anything).

    :param end: epoch seconds when the run ended (later records are teardown)
    """
    jobs: dict[str, dict[str, Any]] = {}
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
        elif event == "job_exited":
            job["ended"] = entry["t"]
            job["exit_removed"] = bool(entry.get("removed"))

    payloads = Counter[str]()
    kill_reasons = Counter[str]()
    outcomes = Counter[str]()
    gate_refusals = 0
    drone_started: dict[str, float] = {}
    for job in jobs.values():
        started = job.get("started")
        if started is None:
            outcomes["released before it started" if "removed" in job else "queued at the end"] += 1
            continue
        drone_started[job["drone"]] = started
        running: set[str] = set()
        killed_here = 0
        truth = Path(job["sandbox"]) / "ep" / GROUND_TRUTH_FILE
        for entry in read_ground_truth(truth):
            if entry["t"] > end:
                continue
            event = entry["event"]
            if event == "payload_started":
                payloads["started"] += 1
                running.add(entry["job_id"])
            elif event == "payload_finished":
                payloads["finished"] += 1
                running.discard(entry["job_id"])
            elif event == "payload_killed":
                payloads["killed"] += 1
                killed_here += 1
                kill_reasons[str(entry.get("reason"))] += 1
                running.discard(entry["job_id"])
            elif event == "payload_refused":
                gate_refusals += 1
        ended = job.get("ended")
        if ended is not None and running:
            payloads["killed"] += len(running)
            kill_reasons["drone removed by the site (condor_rm)"] += len(running)
            killed_here += len(running)
        elif running:
            payloads["running at the end"] += len(running)
        if "removed" in job:
            if killed_here:
                outcomes["removed by the site with payloads running"] += 1
            else:
                outcomes["removed by the site while idle"] += 1
        elif ended is not None:
            outcomes["ended by itself (drained)"] += 1
        else:
            outcomes["running at the end"] += 1

    # what TARDIS saw: the first transition taken while it held "Running"
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
    return {
        "drones": {
            "requested": sum(1 for job in jobs.values() if "submitted" in job),
            "started": len(drone_started),
            **{key: outcomes[key] for key in sorted(outcomes)},
        },
        "payloads": {
            "started": payloads["started"],
            "finished": payloads["finished"],
            "killed": payloads["killed"],
            "running at the end": payloads["running at the end"],
            "refused at the gate": gate_refusals,
        },
        "kill_reasons": dict(kill_reasons),
        "tardis_latency": latency,
        "tardis_transitions": dict(sorted(transitions.items())),
    }
