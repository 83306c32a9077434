"""
The demonstration with drones that end (a walltime, the site's preemptions): its scenario,
and how the analysis tells a payload killed at the drone's end from one TARDIS's removal
killed, and a vacate from a kill, on a hand-made run's records
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.emulation.demo.analysis import SLURM_STATES, analyze
from broker.emulation.demo.scenario import Scenario
from broker.emulation.demo.template import bus_section
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE


def test_a_walltime_is_whole_minutes_on_the_real_slurm() -> None:
    scenario = Scenario(tardis_adapters="slurm", walltime_s=120.0)
    assert scenario.walltime_min == 2 and scenario.drones_end
    assert scenario.payload_ad() == {"AllowedJobDuration": 14}  # the longest payload
    assert bus_section(scenario, "nats://x:1")["drone_start_s"] == 20.0
    assert Scenario(tardis_adapters="slurm").walltime_min == 60  # an hour: beyond the run
    assert Scenario(tardis_adapters="slurm").payload_ad() == {}
    assert "drone_start_s" not in bus_section(Scenario(), "nats://x:1")
    with pytest.raises(ValueError, match="whole number of minutes"):
        Scenario(tardis_adapters="slurm", walltime_s=90.0)
    with pytest.raises(ValueError, match="needs the real Slurm"):
        Scenario(walltime_s=60.0)
    with pytest.raises(ValueError, match="need the real Slurm"):
        Scenario(preemptions=2)


def test_preemptions_are_seeded_and_spread_over_the_swings() -> None:
    scenario = Scenario(tardis_adapters="slurm", preemptions=4, duration_s=90.0)
    times = scenario.preemption_times()
    assert (
        times
        == Scenario(tardis_adapters="slurm", preemptions=4, duration_s=90.0).preemption_times()
    )
    assert len(times) == 4 and times == sorted(times)
    assert all(10.0 <= t <= 90.0 for t in times)
    assert times != Scenario(seed=2, tardis_adapters="slurm", preemptions=4).preemption_times()


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def _job(root: Path, job: str, t: float) -> dict[str, Any]:
    return {"t": t, "event": "job_started", "job_id": job, "drone": f"d{job}", "pid": 1,
            "sandbox": str(root / "jobs" / job)}  # fmt: skip


def test_kills_at_the_drones_end_are_told_from_removals_and_vacates(tmp_path: Path) -> None:
    """
    Job 1 reached its walltime with two payloads running (Slurm: TIMEOUT); TARDIS removed
    job 2 with one running; the site preempted job 3, whose agent vacated one payload and let
    one finish, and job 4, a stock drone that still ran one when the SIGKILL came
    """
    _write(
        tmp_path / "lbs.jsonl",
        [
            *({"t": 100, "event": "job_submitted", "job_id": j, "drone": f"d{j}"} for j in "1234"),
            *(_job(tmp_path, j, 101) for j in "1234"),
            {"t": 120, "event": "job_removed", "job_id": "2", "was": "running"},
            {"t": 120.1, "event": "job_exited", "job_id": "2", "returncode": None, "killed": True},
            {"t": 130, "event": "job_preempted", "job_id": "3"},
            {"t": 133, "event": "job_exited", "job_id": "3", "returncode": 0, "killed": False},
            {"t": 140, "event": "job_preempted", "job_id": "4"},
            {"t": 145, "event": "job_exited", "job_id": "4", "returncode": None, "killed": True},
            {"t": 161, "event": "job_exited", "job_id": "1", "returncode": None, "killed": True},
        ],
    )
    states = {"1": "TIMEOUT", "2": "CANCELLED", "3": "COMPLETED", "4": "FAILED"}
    (tmp_path / SLURM_STATES).write_text(json.dumps(states))
    started = [{"t": 102, "event": "payload_started", "job_id": f"{i}.0"} for i in range(2)]
    for job in "124":
        _write(
            tmp_path / "jobs" / job / "ep" / GROUND_TRUTH_FILE, started[: 1 if job != "1" else 2]
        )
    _write(
        tmp_path / "jobs" / "3" / "ep" / GROUND_TRUTH_FILE,
        [
            *started,
            {"t": 131, "event": "payload_finished", "job_id": "0.0", "runtime_s": 29.0},
            {"t": 132, "event": "payload_killed", "job_id": "1.0", "reason": "drain_fast",
             "runtime_s": 30.0},
        ],
    )  # fmt: skip

    result = analyze(tmp_path, 170.0, cores_per_drone=2, end_rows=True)
    payloads = result["payloads"]
    assert payloads["started"] == 6 and payloads["finished"] == 1
    assert payloads["killed"] == 4  # at the end (3) and by TARDIS's removal (1)
    assert payloads["killed at the drone's end"] == 3
    assert payloads["vacated on notice"] == 1  # not a kill: HTCondor queues it again
    assert result["kill_reasons"] == {
        "the drone's end (walltime: Slurm's TIMEOUT)": 2,
        "drone removed by the site (condor_rm)": 1,
        "the drone's end (preempted by the site)": 1,
    }
    drones = result["drones"]
    assert drones["ended by the batch system at its walltime"] == 1
    assert drones["preempted by the site"] == 2
    assert drones["removed by the site with payloads running"] == 1
    # without the rows asked for, the table is the one of the other runs
    plain = analyze(tmp_path, 170.0, cores_per_drone=2)["payloads"]
    assert "killed at the drone's end" not in plain and "vacated on notice" not in plain
