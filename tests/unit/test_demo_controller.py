"""
The demonstration's controller mode: its seeded payload arrivals, the recorder of demand and
releases inside COBalD, and the rows the analysis makes of a hand-made run's records
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from cobald.composite.factory import FactoryPool
from cobald.composite.weighted import WeightedComposite
from tardis.resources.dronestates import AvailableState, BootingState, DownState

from broker.emulation.demo.analysis import RISE_WINDOW_INTERVALS, Queue, analyze
from broker.emulation.demo.demand import DEMAND_RECORD, DemandRecorder
from broker.emulation.demo.scenario import Scenario
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE

# ---------------------------------------------------------------------- arrivals


def test_the_same_seed_gives_the_same_arrivals() -> None:
    first = Scenario(seed=7, demand="controller").arrivals()
    assert first == Scenario(seed=7, demand="controller").arrivals()
    # what the run does around them does not change them: both runs of a seed see the same
    assert first == Scenario(seed=7, demand="controller", tardis_adapters="htcondor").arrivals()
    assert first == Scenario(seed=7, demand="scripted").arrivals()
    assert first != Scenario(seed=8, demand="controller").arrivals()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_arrivals_follow_the_swings(seed: int) -> None:
    scenario = Scenario(seed=seed, demand="controller")
    arrivals = scenario.arrivals()
    times = [at for at, _ in arrivals]
    assert times == sorted(times)
    assert all(0 <= at < scenario.duration_s for at in times)
    # the n-th payload runs the scenario's n-th duration
    assert [d for _, d in arrivals] == [scenario.payload_duration(n) for n in range(len(arrivals))]
    # none while the swings ask for no cores
    steps = scenario.schedule()
    for (at, cores), (until, _) in itertools.pairwise(steps):
        if cores == 0:
            assert not [t for t in times if at <= t < until]


def test_arrivals_keep_the_demanded_cores_busy_on_average() -> None:
    """Over many seeds, submitted core-seconds match the swings' core-seconds (Little's law)"""
    ratios = []
    for seed in range(1, 61):
        scenario = Scenario(seed=seed, demand="controller")
        steps = scenario.schedule()
        wanted = sum(c * (u - a) for (a, c), (u, _) in itertools.pairwise(steps))
        submitted = sum(duration for _, duration in scenario.arrivals())
        ratios.append(submitted / wanted)
    assert 0.9 < statistics.fmean(ratios) < 1.1


def test_a_scenario_refuses_an_unknown_demand() -> None:
    with pytest.raises(ValueError, match="demand must be one of scripted, controller"):
        Scenario(demand="linear")


# ---------------------------------------------------------------------- the recorder


class Drone:
    """What COBalD's FactoryPool and the recorder read of a TARDIS drone"""

    def __init__(self, name: str) -> None:
        self.resource_attributes = {"drone_uuid": name}
        self.demand = 2.0
        self.supply = self.utilisation = self.allocation = 0.0
        self.state: Any = None


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_recorder_writes_demand_changes_spawns_releases_and_ends(tmp_path: Path) -> None:
    first, second = Drone("d1"), Drone("d2")
    pool = FactoryPool(first, factory=lambda: Drone("dx"), interval=1)
    path = tmp_path / DEMAND_RECORD
    recorder = DemandRecorder(WeightedComposite(pool), str(path))

    recorder.demand = 4.0
    recorder.demand = 4.0  # no change: no record
    assert recorder.demand == 4.0
    first.state = BootingState()
    recorder.look()
    pool._hatchery.add(second)  # as FactoryPool._grow adds what its factory made
    second.state = AvailableState()
    recorder.look()
    first.demand = 0.0  # released by the pool while TARDIS had it booting
    first.state = AvailableState()  # ... which it may leave before the next look
    second.state = DownState()
    recorder.look()
    recorder.look()  # nothing new
    second.demand = 0.0  # TARDIS's DownState sets it
    recorder.look()

    records = [{k: v for k, v in r.items() if k != "t"} for r in _records(path)]
    assert records == [
        {
            "event": "demand",
            "value": 4.0,
            "was": 2.0,
            "supply": 0.0,
            "utilisation": 1.0,
            "allocation": 1.0,
        },
        {"event": "spawn", "drone": "d1"},
        {"event": "spawn", "drone": "d2"},
        {"event": "release", "drone": "d1", "state": "BootingState"},
        {"event": "down", "drone": "d2"},
    ]


# ---------------------------------------------------------------------- the analysis


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """
    A hand-made run: three drone jobs, four payloads submitted, COBalD's records

    The queue: 1.0 waits 1.5 s, 2.0 3 s, 3.0 4 s; 4.0 (submitted at 108.5) never starts.
    """
    job = {k: tmp_path / "jobs" / k / "ep" for k in ("1_0", "2_0")}
    _write(
        tmp_path / "lbs.jsonl",
        [
            {"t": 100, "event": "job_submitted", "job_id": "1.0", "drone": "d1"},
            {"t": 100, "event": "job_submitted", "job_id": "2.0", "drone": "d2"},
            {"t": 101, "event": "job_started", "job_id": "1.0", "drone": "d1", "pid": 1,
             "sandbox": str(job["1_0"].parent)},
            {"t": 103, "event": "job_started", "job_id": "2.0", "drone": "d2", "pid": 2,
             "sandbox": str(job["2_0"].parent)},
            {"t": 104, "event": "job_submitted", "job_id": "3.0", "drone": "d3"},
            {"t": 106, "event": "job_removed", "job_id": "3.0", "drone": "d3", "was": "idle"},
            {"t": 110, "event": "job_removed", "job_id": "2.0", "drone": "d2", "was": "running"},
            {"t": 110.5, "event": "job_exited", "job_id": "2.0", "drone": "d2", "removed": True},
        ],
    )  # fmt: skip
    _write(
        job["1_0"] / GROUND_TRUTH_FILE,
        [
            {"t": 101.5, "event": "payload_started", "job_id": "1.0"},
            {"t": 105, "event": "payload_finished", "job_id": "1.0", "runtime_s": 3.5},
            {"t": 106, "event": "payload_started", "job_id": "3.0"},
        ],
    )
    _write(
        job["2_0"] / GROUND_TRUTH_FILE, [{"t": 104, "event": "payload_started", "job_id": "2.0"}]
    )
    _write(
        tmp_path / "obs.jsonl",
        [
            {"t": t, "event": "payload_submitted", "job_id": j, "duration_s": 5}
            for t, j in ((100, "1.0"), (101, "2.0"), (102, "3.0"), (108.5, "4.0"))
        ],
    )
    _write(
        tmp_path / DEMAND_RECORD,
        [
            {"t": 100, "event": "demand", "value": 2.0, "was": 0.0},
            {"t": 100.1, "event": "spawn", "drone": "d1"},
            {"t": 100.2, "event": "spawn", "drone": "d2"},
            {"t": 100.3, "event": "spawn", "drone": "d4"},
            {"t": 103, "event": "demand", "value": 1.5, "was": 2.0},  # 2 payloads queued
            {"t": 103.5, "event": "release", "drone": "d2", "state": "BootingState"},
            {"t": 104.1, "event": "spawn", "drone": "d3"},
            {"t": 105, "event": "release", "drone": "d3", "state": "BootingState"},
            {"t": 107, "event": "demand", "value": 1.0, "was": 1.5},  # none queued
            {"t": 108, "event": "release", "drone": "d4", "state": "AvailableState"},
            {"t": 109, "event": "demand", "value": 2.0, "was": 1.0},
            {"t": 109.5, "event": "spawn", "drone": "d5"},
            {"t": 125, "event": "demand", "value": 5.0, "was": 2.0},  # after the end
        ],
    )
    return tmp_path


def test_the_queue_over_time() -> None:
    queue = Queue({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 2.5, "b": 2.5})
    assert [queue.length(t) for t in (0.5, 1.0, 2.0, 2.5, 3.0)] == [0, 1, 2, 0, 1]
    assert sorted(queue.waits(end=10.0)) == [0.5, 1.5, 7.0]


def test_the_analysis_of_a_hand_made_run(run: Path) -> None:
    # the controller's interval: 0.01 s, so a release is followed by a rise within 3 s
    result = analyze(run, 120.0, cores_per_drone=2, controller_interval_s=0.01)
    window = f"within {RISE_WINDOW_INTERVALS} intervals (3 s)"

    assert result["queue"] == {
        "submitted": 4,
        "queued at the end": 1,
        "wait_s": {"median": 3.5, "p90": 11.5, "mean": 5.0},  # 4.0 counts 120 - 108.5
    }
    payloads = result["payloads"]
    assert (payloads["finished"], payloads["killed"], payloads["running at the end"]) == (1, 1, 1)
    # the accounting closes: each payload submitted finished, was killed, runs or waits
    assert result["queue"]["submitted"] == (
        payloads["finished"]
        + payloads["killed"]
        + payloads["running at the end"]
        + result["queue"]["queued at the end"]
    )
    assert result["controller"] == {
        "demand-lowering steps": 2,
        "demand-lowering steps while payloads were queued": 1,
        "cores of demand lowered while payloads were queued": 0.5,
        "demand (cores, max)": 2.0,
        "drones released by the pool": 3,
        # d4's: demand rose from 1 to 2 a second later; d2's and d3's: it did not
        f"releases followed by a demand rise {window}": 1,
        # d2's (d3 spawned) and d4's (d5 spawned)
        f"releases followed by a new drone {window}": 2,
        # d2 (2 queued) and d3 (1 queued), TARDIS had both booting; d2's job ran already
        "releases of booting drones while payloads were queued": 2,
        "of them already running at the site": 1,
    }


def test_a_scripted_run_has_no_queue_or_controller_rows(run: Path) -> None:
    result = analyze(run, 120.0, cores_per_drone=2)
    assert "queue" not in result and "controller" not in result
