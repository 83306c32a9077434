"""
The node's part of a Slurm drone job (the site's StartupCommand, ``slurm_site.py``)

Its one rule: the job records its start and its end in the site's ground truth and waits
for the drone it runs. It stands where a site's StartupCommand (the shipped ``drone-job``,
which execs the agent) is the batch script, so a signal that Slurm sends to the batch
script alone (``scancel --batch``, ``sbatch --signal=B:...``) is passed on to the drone; an
``scancel`` signals every process of the job, the drone too, and this one keeps waiting
(Slurm's SIGKILL ends it after ``KillWait``; the site's follower then records the end).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from types import FrameType

from broker.emulation.execution_point.install import install_fake_condor
from broker.emulation.groundtruth import GroundTruth
from remote_agent.deploy_files import DEPLOY_DIR

DRONE_JOB = DEPLOY_DIR / "slurm" / "drone-job"


def main(site: str) -> int:
    """Run the drone of this job (``SLURM_JOB_ID``) for the site whose files are in ``site``"""
    root = Path(site)
    conf = json.loads((root / "site.json").read_text())
    job = os.environ["SLURM_JOB_ID"]
    drone = os.environ.get("TardisDroneUuid", "")  # noqa: SIM112 (TARDIS names it)
    sandbox = Path(conf["jobs"]) / job
    host = f"{drone or job}.slurm"
    if conf["mode"] == "remote":
        env = install_fake_condor(
            sandbox / "bin", sandbox / "ep", slots=int(conf["slots"]), host=host
        )
        env["COBALD_REMOTE_DRONE_ENV"] = str(root / "drone.env")
        env["COBALD_REMOTE_SPOOL_DIR"] = str(sandbox / "spool")
        argv = [str(DRONE_JOB)]
    else:  # a stock drone: the startd alone; graceful drains let payloads finish
        env = install_fake_condor(
            sandbox / "bin",
            sandbox / "ep",
            slots=int(conf["slots"]),
            host=host,
            deploy_config=None,
            extra_config={"MAXJOBRETIREMENTTIME": "10000000"},
        )
        argv = ["condor_master", "-f"]
    env["PYTHONPATH"] = str(conf["root"])  # the fake condor tools import the emulator
    truth = GroundTruth(root / "lbs.jsonl")
    try:
        truth.record(
            "job_started",
            job_id=job,
            drone=drone,
            sandbox=str(sandbox),
            pid=os.getpid(),
            env=dict(os.environ),  # what Slurm passed to the job
        )
        child: list[subprocess.Popen[bytes]] = []

        def forward(signum: int, _: FrameType | None) -> None:
            for proc in child:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, forward)
        child.append(subprocess.Popen(argv, env=env))
        code = child[0].wait()
        truth.record("job_exited", job_id=job, drone=drone, returncode=code, killed=False)
    finally:
        truth.close()
    return code
