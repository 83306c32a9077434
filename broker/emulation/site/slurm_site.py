"""
A Slurm site for TARDIS: the real cluster of ``slurm.py``, drone jobs, recorded Slurm clients

Its one rule: the drone job is what the site's StartupCommand runs under slurmd, with the
environment Slurm gives it. With cobald-remote that is the shipped
``deploy/slurm/drone-job``; a stock drone runs the emulated ``condor_master`` alone. What a
worker node would have installed stands in each job's sandbox: the emulated HTCondor
execution point and the node's ``drone.env``, which the shipped script reads.

Ground truth, written beside TARDIS and independent of it: ``lbs.jsonl`` gets each job's
``job_submitted``, ``job_started``, ``job_removed`` (an ``scancel`` of a queued or running
job, ``was`` ``idle`` or ``running``) and ``job_exited``, in the local batch system's
format (``analysis.py`` reads both); ``slurm.jsonl`` every call of ``sbatch``, ``squeue``
and ``scancel`` that went through :attr:`SlurmSite.tools_dir`, with its wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import broker
from broker.emulation.groundtruth import GroundTruth, read_ground_truth
from broker.emulation.site.overlay import OverlayPool
from broker.emulation.site.slurm import KILL_WAIT_S, PARTITION, SlurmCluster
from remote_agent.deploy_files import DEPLOY_DIR

#: where ``broker`` is imported from: the jobs and tools import it from there too
IMPORT_ROOT = Path(broker.__file__).resolve().parent.parent
DRONE_JOB = DEPLOY_DIR / "slurm" / "drone-job"
RECORDED = ("sbatch", "squeue", "scancel")

#: the node's part of a drone job (the site's StartupCommand)
_JOB = """\
#!{python}
# a Slurm site's drone job: broker/emulation/site/slurm_site.py
import sys
sys.path.insert(0, {root!r})
from broker.emulation.site.slurm_job import main
sys.exit(main({site!r}))
"""

_TOOL = """\
#!{python}
# a recorded {name}: broker/emulation/site/slurm_site.py
import sys
sys.path.insert(0, {root!r})
from broker.emulation.site.slurm_tools import main
sys.exit(main({name!r}, {real!r}, {squeue!r}, {site!r}, sys.argv[1:]))
"""


@dataclass
class SlurmSite:
    """
    The drone jobs of one run on ``cluster``, files under ``root``

    :param mode: ``remote`` (the agent around the startd, with the gate hooks) or
        ``stock`` (the startd alone, graceful drains let payloads finish)
    """

    cluster: SlurmCluster
    root: Path
    mode: str = "remote"
    slots: int = 1
    agent_heartbeat_s: float = 2.0
    agent_poll_s: float = 0.2
    end_grace_s: float = 2.0
    #: what the drone keeps for its own end before the batch system's (the agent's --end-margin)
    end_margin_s: float = 2.0
    #: what a warning signal (sbatch --signal=B:USR1@N) gives the drone, if the site sends one
    warning_grace_s: float | None = None
    joined: set[str] = field(default_factory=set)
    left: set[str] = field(default_factory=set)

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def startup_command(self) -> Path:
        return startup_command(self.root)

    @property
    def tools_dir(self) -> Path:
        """The recorded ``sbatch``, ``squeue`` and ``scancel``: first on TARDIS's ``PATH``"""
        return self.root / "bin"

    @property
    def truth_file(self) -> Path:
        return self.root / "lbs.jsonl"

    @property
    def calls_file(self) -> Path:
        return self.root / "slurm.jsonl"

    def write(self) -> None:
        """The node's ``drone.env``, the job script and the recorded Slurm clients"""
        self.jobs.mkdir(parents=True, exist_ok=True)
        cli = Path(sys.executable).parent / "cobald-remote"
        if not cli.is_file():  # the drone job runs the agent by one absolute path
            cli = self.root / "cobald-remote"
            cli.write_text(f'#!/bin/sh\nexec {sys.executable} -m broker.cli "$@"\n')
            cli.chmod(0o755)
        (self.root / "drone.env").write_text(
            f"COBALD_REMOTE={cli}\n"
            f"COBALD_REMOTE_POLL_S={self.agent_poll_s}\n"
            f"COBALD_REMOTE_HEARTBEAT_S={self.agent_heartbeat_s}\n"
            f"COBALD_REMOTE_END_GRACE_S={self.end_grace_s}\n"
            # within Slurm's KillWait (slurm.py): the payloads get their grace time
            f"COBALD_REMOTE_KILL_AFTER_S={KILL_WAIT_S}\n"
            # a SIGTERM from Slurm is followed by its SIGKILL after KillWait
            f"COBALD_REMOTE_TERM_GRACE_S={KILL_WAIT_S}\n"
            f"COBALD_REMOTE_END_MARGIN_S={self.end_margin_s}\n"
            # the node's Slurm configuration, as a worker node has it: squeue finds the cluster
            f"SLURM_CONF={self.cluster.conf}\n"
            + (
                f"COBALD_REMOTE_WARNING_GRACE_S={self.warning_grace_s}\n"
                if self.warning_grace_s is not None
                else ""
            )
        )
        (self.root / "site.json").write_text(
            json.dumps(
                {
                    "mode": self.mode,
                    "slots": self.slots,
                    "jobs": str(self.jobs),
                    "root": str(IMPORT_ROOT),
                }
            )
        )
        common = {"python": sys.executable, "root": str(IMPORT_ROOT), "site": str(self.root)}
        self.startup_command.write_text(_JOB.format(**common))
        self.startup_command.chmod(0o755)
        self.tools_dir.mkdir(exist_ok=True)
        for name in RECORDED:
            tool = self.tools_dir / name
            real, squeue = self.cluster.programs[name], self.cluster.programs["squeue"]
            tool.write_text(_TOOL.format(name=name, real=real, squeue=squeue, **common))
            tool.chmod(0o755)

    def tardis_site(self, machine_type: str, cores: int) -> dict[str, Any]:
        """TARDIS's section of this site (its ``SlurmAdapter``)"""
        return tardis_site(self.startup_command, machine_type, cores)

    def preempt(self, rng: random.Random) -> str | None:
        """
        Preempt one drone job that runs (chosen by ``rng``) as Slurm's ``PreemptMode=CANCEL``
        does: SIGTERM to each of its processes now, SIGKILL after ``KillWait``
        (:meth:`kill_preempted`); recorded as ``job_preempted`` in the ground truth. The
        job preempted, ``None`` if none runs
        """
        entries = read_ground_truth(self.truth_file)
        over = {e["job_id"] for e in entries if e["event"] in ("job_exited", "job_preempted")}
        running = sorted(
            (
                e["job_id"]
                for e in entries
                if e["event"] == "job_started" and e["job_id"] not in over
            ),
            key=int,
        )
        running = [job for job in running if self.state(job) == "RUNNING"]
        if not running:
            return None
        job = str(rng.choice(running))
        truth = GroundTruth(self.truth_file)
        try:
            truth.record("job_preempted", job_id=job)
        finally:
            truth.close()
        self.cluster.run("scancel", "--signal=TERM", "--full", job, check=False)
        return job

    def kill_preempted(self, job: str) -> None:
        """The SIGKILL of a preemption (``KillWait`` after its SIGTERM) to what still runs"""
        if self.state(job) in ("RUNNING", "COMPLETING"):
            self.cluster.run("scancel", "--signal=KILL", "--full", job, check=False)

    def final_states(self) -> dict[str, str]:
        """
        Slurm's own word on how each job submitted so far ended (``scontrol``'s
        ``JobState``: ``COMPLETED``, ``TIMEOUT``, ``CANCELLED``, ``PREEMPTED``, ...), by job id;
        ``""`` for a job Slurm forgot
        """
        jobs = [
            e["job_id"] for e in read_ground_truth(self.truth_file) if e["event"] == "job_submitted"
        ]
        return {job: self.state(job) for job in jobs}

    # ------------------------------------------------------------ reading the records

    def calls(self, tool: str | None = None) -> list[dict[str, Any]]:
        """The recorded calls (``event`` the tool, ``args``, ``wall_s``, ``state``), in order"""
        return [
            entry
            for entry in read_ground_truth(self.calls_file)
            if tool is None or entry["event"] == tool
        ]

    def scancels_of(self, state: str) -> list[dict[str, Any]]:
        """``scancel``s of jobs that were in ``state`` (``RUNNING``, ``PENDING``) at the call"""
        return [call for call in self.calls("scancel") if call.get("state") == state]

    def events(self, job_id: int | str) -> dict[str, dict[str, Any]]:
        """The ground truth of one job, by event (``job_started``: drone, sandbox, env)"""
        return {
            entry["event"]: entry
            for entry in read_ground_truth(self.truth_file)
            if entry.get("job_id") == str(job_id)
        }

    def started(self, job_id: int | str) -> dict[str, Any] | None:
        return self.events(job_id).get("job_started")

    def ended(self, job_id: int | str) -> dict[str, Any] | None:
        return self.events(job_id).get("job_exited")

    def state(self, job_id: int | str) -> str:
        """The job's state as ``scontrol`` shows it (``""`` once Slurm forgot it)"""
        return self.cluster.job(job_id).get("JobState", "")

    async def wait_state(self, job_id: int | str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job_id)) not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state!r}, not one of {sorted(states)}")
            await asyncio.sleep(0.2)
        return state

    # ------------------------------------------------------------ the overlay pool

    @contextlib.asynccontextmanager
    async def following(self, overlay: OverlayPool) -> AsyncIterator[None]:
        """Each drone job that starts joins ``overlay``; each that ends leaves it"""
        truth = GroundTruth(self.truth_file)
        task = asyncio.create_task(self._follow(overlay, truth))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._follow_once(overlay, truth)
            truth.close()

    async def _follow(self, overlay: OverlayPool, truth: GroundTruth) -> None:
        while True:
            self._follow_once(overlay, truth)
            await asyncio.sleep(0.1)

    def _follow_once(self, overlay: OverlayPool, truth: GroundTruth) -> None:
        entries = read_ground_truth(self.truth_file)
        exited = {e["job_id"] for e in entries if e["event"] == "job_exited"}
        for entry in entries:
            if entry["event"] != "job_started":
                continue
            job, drone = entry["job_id"], str(entry["drone"])
            if job not in self.joined:
                overlay.join(drone, Path(entry["sandbox"]) / "ep")
                self.joined.add(job)
            if job in self.left:
                continue
            if job in exited:
                overlay.leave(drone)
                self.left.add(job)
            elif not _alive(int(entry["pid"])):  # killed before it could write its end
                truth.record("job_exited", job_id=job, drone=drone, returncode=None, killed=True)
                overlay.leave(drone)
                self.left.add(job)


def startup_command(root: Path) -> Path:
    """The site's StartupCommand, for a site whose files are under ``root``"""
    return root / "drone-job"


def tardis_site(
    startup: Path, machine_type: str, cores: int, walltime_min: int = 60
) -> dict[str, Any]:
    """
    TARDIS's section of a Slurm site whose StartupCommand is ``startup``; TARDIS submits
    each drone with ``--time`` ``walltime_min`` and passes it as ``SLURM_Walltime``
    """
    # sbatch writes a job's output to the submit directory (the daemon's) unless told
    output = {"long": {"output": str(startup.parent / "jobs" / "slurm-%j.out")}}
    return {
        "MachineTypes": [machine_type],
        "MachineTypeConfiguration": {
            machine_type: {
                "Walltime": walltime_min,
                "Partition": PARTITION,
                "StartupCommand": str(startup),
                "SubmitOptions": output,
            }
        },
        "MachineMetaData": {machine_type: {"Cores": cores, "Memory": 0.25, "Disk": 1}},
        "bulk_delay": 0.1,
    }


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def slurm_environment(site: SlurmSite, *extra_tools: Path) -> dict[str, str]:
    """The environment of whatever runs TARDIS: the recorded clients first, the cluster's conf"""
    env = site.cluster.env()
    env["PATH"] = os.pathsep.join([str(site.tools_dir), *map(str, extra_tools), env["PATH"]])
    return env
