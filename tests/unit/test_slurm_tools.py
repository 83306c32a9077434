"""
The recorded Slurm clients (``broker/emulation/site/slurm_tools.py``) in front of stand-ins:
the real client's output and exit code pass through, the record names the job and the drone
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.emulation.groundtruth import read_ground_truth
from broker.emulation.site.slurm_tools import main


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def squeue(tmp_path: Path) -> str:
    """An ``squeue`` that lists every job as running"""
    return _script(tmp_path / "squeue", "echo RUNNING")


def test_sbatch_passes_through_and_records_the_submitted_drone(
    tmp_path: Path, squeue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sbatch = _script(tmp_path / "sbatch", 'echo "Submitted batch job 42"')
    args = ["-p", "drones", "--export=SLURM_Walltime=60,TardisDroneUuid=site1-0123456789", "job"]
    assert main("sbatch", sbatch, squeue, str(tmp_path), args) == 0
    assert capsys.readouterr().out == "Submitted batch job 42\n"  # what TARDIS parses
    [submitted] = read_ground_truth(tmp_path / "lbs.jsonl")
    assert (submitted["event"], submitted["job_id"], submitted["drone"]) == (
        "job_submitted",
        "42",
        "site1-0123456789",
    )
    [call] = read_ground_truth(tmp_path / "slurm.jsonl")
    assert call["event"] == "sbatch" and call["returncode"] == 0 and call["wall_s"] >= 0


def test_scancel_of_a_running_job_is_a_removal_and_a_failure_passes_through(
    tmp_path: Path, squeue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    scancel = _script(tmp_path / "scancel", 'echo "scancel: error: $1" >&2; exit 3')
    assert main("scancel", scancel, squeue, str(tmp_path), ["7"]) == 3
    assert capsys.readouterr().err == "scancel: error: 7\n"
    [removed] = read_ground_truth(tmp_path / "lbs.jsonl")
    assert (removed["event"], removed["job_id"], removed["was"]) == ("job_removed", "7", "running")
    [call] = read_ground_truth(tmp_path / "slurm.jsonl")
    assert (call["state"], call["returncode"]) == ("RUNNING", 3)


def test_squeue_records_its_wall_time_only(tmp_path: Path, squeue: str) -> None:
    assert main("squeue", squeue, squeue, str(tmp_path), ["-h", "--job=1,2"]) == 0
    assert read_ground_truth(tmp_path / "lbs.jsonl") == []
    [call] = read_ground_truth(tmp_path / "slurm.jsonl")
    assert call["event"] == "squeue" and call["args"] == "-h --job=1,2"
