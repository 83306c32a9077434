"""
A Slurm site for TARDIS in the tests: the real cluster of ``support.slurm`` with drone jobs

Its one rule: the drone job is the shipped ``deploy/slurm/drone-job``, run by slurmd with
the environment Slurm gives it. What a worker node would have installed stands in the
job's own sandbox: the emulated HTCondor execution point (``install_fake_condor``) and the
node's ``drone.env``, which the shipped script reads. The Slurm clients TARDIS calls are
recorded on the way (``sbatch``, ``squeue``, ``scancel``, with the job's state at each
``scancel``), and each started drone joins the emulated overlay pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import broker
from broker.emulation.groundtruth import GroundTruth
from broker.emulation.site.collector import install_fake_collector
from broker.emulation.site.overlay import OverlayPool
from remote_agent.deploy_files import DEPLOY_DIR
from support.slurm import PARTITION, SlurmCluster

REPO = Path(broker.__file__).resolve().parent.parent
DRONE_JOB = DEPLOY_DIR / "slurm" / "drone-job"
RECORDED = ("sbatch", "squeue", "scancel")

#: the node's part of a drone job (the site's StartupCommand): an emulated execution point
#: in the job's sandbox, then the shipped drone job; marks its start and its end
_JOB = """\
#!{python}
# a Slurm site's drone job for the tests: tests/support/slurm_site.py
import json, os, signal, subprocess, sys
sys.path.insert(0, {repo!r})
from broker.emulation.execution_point import install_fake_condor

sandbox = os.path.join({jobs!r}, os.environ["SLURM_JOB_ID"])
env = install_fake_condor(sandbox + "/bin", sandbox + "/ep", slots=1)
env.update(PYTHONPATH={repo!r}, COBALD_REMOTE_DRONE_ENV={drone_env!r},
           COBALD_REMOTE_SPOOL_DIR=sandbox + "/spool")
mark = dict(drone=os.environ.get("TardisDroneUuid"), ep=sandbox + "/ep",
            env=dict(os.environ))
with open(sandbox + "/started.json", "w") as f:
    json.dump(mark, f)
# scancel signals every process of the job: this one waits for the drone job's end
signal.signal(signal.SIGTERM, lambda *_: None)
code = subprocess.call([{drone_job!r}], env=env)
with open(sandbox + "/ended.json", "w") as f:
    json.dump(dict(returncode=code), f)
sys.exit(code)
"""

_TOOL = """\
#!/bin/sh
# a recorded {name} for the tests: tests/support/slurm_site.py
{extra}printf '%s {name} %s\\n' "$(date +%s.%N)" "$*{state}" >> {log}
exec {real} "$@"
"""

_STATE = """\
for job; do :; done
state=$({squeue} -h -t all -o %T -j "$job" 2>/dev/null || true)
"""


@dataclass(frozen=True)
class Call:
    at: float
    tool: str
    args: str


@dataclass
class SlurmSite:
    """The drone jobs of one test on ``cluster``; :meth:`tools_dir` goes first on ``PATH``"""

    cluster: SlurmCluster
    root: Path
    heartbeat_s: float = 2.0
    payload_s: float = 3.0
    overlay: OverlayPool | None = None
    truth: GroundTruth | None = None
    joined: set[str] = field(default_factory=set)
    left: set[str] = field(default_factory=set)

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def startup_command(self) -> Path:
        return self.root / "drone-job"

    @property
    def tools_dir(self) -> Path:
        return self.root / "bin"

    def write(self) -> None:
        """The node's drone.env and job wrapper, and the recorded Slurm clients"""
        self.jobs.mkdir(parents=True, exist_ok=True)
        drone_env = self.root / "drone.env"
        cli = Path(sys.executable).parent / "cobald-remote"
        assert cli.is_file(), "the cobald-remote command of this environment"
        drone_env.write_text(
            f"COBALD_REMOTE={cli}\n"
            "COBALD_REMOTE_POLL_S=0.2\n"
            f"COBALD_REMOTE_HEARTBEAT_S={self.heartbeat_s}\n"
            "COBALD_REMOTE_END_GRACE_S=2\n"
        )
        self.startup_command.write_text(
            _JOB.format(
                python=sys.executable,
                repo=str(REPO),
                jobs=str(self.jobs),
                drone_env=str(drone_env),
                drone_job=str(DRONE_JOB),
            )
        )
        self.startup_command.chmod(0o755)
        self.tools_dir.mkdir(exist_ok=True)
        squeue = self.cluster.programs["squeue"]
        for name in RECORDED:
            real = self.cluster.programs[name]
            scancel = name == "scancel"
            tool = self.tools_dir / name
            tool.write_text(
                _TOOL.format(
                    name=name,
                    real=real,
                    log=self.root / "calls.log",
                    extra=_STATE.format(squeue=squeue) if scancel else "",
                    state=" $state" if scancel else "",
                )
            )
            tool.chmod(0o755)

    def calls(self, tool: str | None = None) -> list[Call]:
        """The recorded calls of the Slurm clients, in order"""
        path = self.root / "calls.log"
        lines = path.read_text().splitlines() if path.exists() else []
        found = []
        for line in lines:
            at, name, *rest = line.split(" ", 2)
            if tool is None or name == tool:
                found.append(Call(float(at), name, rest[0] if rest else ""))
        return found

    def scancels_of(self, state: str) -> list[Call]:
        """``scancel``s of jobs that were in ``state`` (``RUNNING``, ``PENDING``) at the call"""
        return [call for call in self.calls("scancel") if call.args.endswith(f" {state}")]

    def started(self, job_id: int | str) -> dict[str, Any] | None:
        """What the job saw at its start (drone, environment), or ``None`` if it never ran"""
        path = self.jobs / str(job_id) / "started.json"
        return json.loads(path.read_text()) if path.exists() else None

    def ended(self, job_id: int | str) -> dict[str, Any] | None:
        """The drone job's exit, once the job script saw it end"""
        path = self.jobs / str(job_id) / "ended.json"
        return json.loads(path.read_text()) if path.exists() else None

    def job_ids(self) -> list[int]:
        """The Slurm jobs of this site's drones that started"""
        return sorted(int(p.name) for p in self.jobs.iterdir() if p.name.isdigit())

    def tardis_configuration(self) -> dict[str, Any]:
        """TARDIS's configuration of this site (Slurm) and the overlay pool (HTCondor)"""
        return {
            "BatchSystem": {
                "adapter": "HTCondor",
                "max_age": 0.05,  # minutes
                "ratios": {"cpu_ratio": "Real(TotalSlotCpus-Cpus)/TotalSlotCpus"},
            },
            "Sites": [
                {"name": "Site1", "adapter": "Slurm", "quota": 2, "drone_heartbeat_interval": 1}
            ],
            "Site1": {
                "MachineTypes": ["m1"],
                "MachineTypeConfiguration": {
                    "m1": {
                        "Walltime": 10,
                        "Partition": PARTITION,
                        "StartupCommand": str(self.startup_command),
                    }
                },
                "MachineMetaData": {"m1": {"Cores": 1, "Memory": 0.25, "Disk": 1}},
                "bulk_delay": 0.1,
            },
        }

    # ------------------------------------------------------------ the overlay pool

    @contextlib.asynccontextmanager
    async def running_overlay(self) -> AsyncIterator[OverlayPool]:
        """The overlay pool: each drone job that starts joins, each that ends leaves"""
        self.truth = GroundTruth(self.root / "obs.jsonl")
        overlay = OverlayPool(self.root / "obs", lambda _: self.payload_s, self.truth)
        self.overlay = overlay
        await overlay.start()
        follow = asyncio.create_task(self._follow(overlay))
        try:
            yield overlay
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            await overlay.close()
            self.truth.close()

    def collector_dir(self) -> Path:
        assert self.overlay is not None
        return install_fake_collector(self.root / "collector-bin", self.overlay.socket)

    async def _follow(self, overlay: OverlayPool) -> None:
        while True:
            for job in map(str, self.job_ids()):
                started = self.started(job)
                if started is None:
                    continue
                if job not in self.joined:
                    overlay.join(str(started["drone"]), Path(started["ep"]))
                    self.joined.add(job)
                if job not in self.left and self.ended(job) is not None:
                    overlay.leave(str(started["drone"]))
                    self.left.add(job)
            await asyncio.sleep(0.1)

    def state(self, job_id: int | str) -> str:
        """The job's state as ``scontrol`` shows it (``""`` once Slurm forgot it)"""
        return self.cluster.job(job_id).get("JobState", "")

    async def wait_state(self, job_id: int | str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job_id)) not in states:
            assert time.monotonic() < deadline, f"job {job_id} still {state}, not {states}"
            await asyncio.sleep(0.2)
        return state
