"""
Recorded Slurm clients: ``sbatch``, ``squeue`` and ``scancel`` as TARDIS calls them, recorded

Its one rule: the real client runs with the caller's arguments, and its output and exit
code pass through unchanged; the record is a side effect (``slurm_site.py`` names the files).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker.emulation.groundtruth import GroundTruth

_SUBMITTED = re.compile(r"^Submitted batch job (\d+)", flags=re.MULTILINE)
_DRONE = re.compile(r"TardisDroneUuid=([^,\s]+)")
#: how a removal finds the job: the local batch system's words
_WAS = {"PENDING": "idle", "RUNNING": "running"}


def _state(squeue: str, job: str) -> str:
    if not job.isdigit():
        return ""
    result = subprocess.run(
        [squeue, "-h", "-t", "all", "-o", "%T", "-j", job], capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def main(name: str, real: str, squeue: str, site: str, args: Sequence[str]) -> int:
    """Run ``real`` with ``args`` for ``name``; record the call and what it did to the jobs"""
    root = Path(site)
    fields: dict[str, Any] = {"args": " ".join(args)}
    jobs = GroundTruth(root / "lbs.jsonl")
    try:
        if name == "scancel":
            job = args[-1] if args else ""
            fields["state"] = state = _state(squeue, job)
            if state in _WAS:
                jobs.record("job_removed", job_id=job, was=_WAS[state])
        started = time.monotonic()
        result = subprocess.run([real, *args], capture_output=True, text=True)
        fields["wall_s"] = round(time.monotonic() - started, 4)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        submitted = _SUBMITTED.search(result.stdout) if name == "sbatch" else None
        if submitted is not None:
            drone = _DRONE.search(" ".join(args))
            jobs.record("job_submitted", job_id=submitted[1], drone=drone[1] if drone else None)
    finally:
        jobs.close()
    calls = GroundTruth(root / "slurm.jsonl")
    try:
        calls.record(name, returncode=result.returncode, **fields)
    finally:
        calls.close()
    return result.returncode
