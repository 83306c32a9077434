"""
A real single-node Slurm: munged, slurmctld and slurmd started from a directory of their own

Its one rule: every daemon it starts it stops, by the PID it started, also when the caller
fails. The cluster runs as root on loopback with its own ports, key, state and spool
directories (Debian's ``slurm-wlm`` and ``munge`` packages; ``./run test`` installs them
where it can). Clients find it through ``SLURM_CONF``, which :meth:`SlurmCluster.env` gives.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from broker.emulation.errors import SlurmUnavailable
from broker.emulation.ports import free_ports

#: the daemons and clients the cluster needs
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
NODE = "drones1"
PARTITION = "drones"
#: cores the node claims: drones oversubscribe them (``OverSubscribe=FORCE``)
CPUS = 2
#: jobs that may share a core
OVERSUBSCRIBE = 16
#: seconds from an ``scancel``'s SIGTERM to its SIGKILL (Slurm's default: 30)
KILL_WAIT_S = 5


def missing() -> str | None:
    """Why a real Slurm cannot run here, or ``None``"""
    absent = [name for name in PROGRAMS if _which(name) is None]
    if absent:
        return f"Slurm not installed (packages slurm-wlm and munge): no {', '.join(absent)}"
    if os.geteuid() != 0:
        return "a single-node Slurm here runs its daemons as root"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _memory_mb() -> int:
    """What the node may offer: below what slurmd measures, or the node is invalid"""
    text = Path("/proc/meminfo").read_text()
    match = re.search(r"^MemTotal:\s+(\d+) kB", text, flags=re.MULTILINE)
    total = int(match.group(1)) // 1024 if match else 2048
    return max(256, min(8192, total // 2))


@dataclass
class SlurmCluster:
    """The cluster in ``root``; :meth:`start` it, :meth:`stop` it"""

    root: Path
    memory_mb: int = field(default_factory=_memory_mb)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: the programs by absolute path, found once: a test may put wrappers on ``PATH``
    programs: dict[str, str] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm clients talk to this cluster"""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self, timeout_s: float = 60.0) -> None:
        """Write the key and ``slurm.conf``, start the three daemons, wait for an idle node"""
        self.programs = {name: path for name in PROGRAMS if (path := _which(name))}
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        ctld_port, node_port = free_ports(2)
        self.conf.write_text(self._config(ctld_port, node_port))
        log = self.root / "log"
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            f"--log-file={log / 'munged.log'}",
        )
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-N", NODE, "-f", str(self.conf))
        self._wait(self._idle, timeout_s, f"node {NODE} idle in sinfo")

    def _config(self, ctld_port: int, node_port: int) -> str:
        root = self.root
        return "\n".join(
            [
                "# a single-node cluster for the tests (tests/support/slurm.py)",
                "ClusterName=cobaldremote",
                "SlurmctldHost=localhost(127.0.0.1)",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={node_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SchedulerType=sched/builtin",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                # finished jobs stay visible to squeue and scontrol for this long
                "MinJobAge=600",
                f"KillWait={KILL_WAIT_S}",
                "SlurmdTimeout=60",
                "InactiveLimit=0",
                f"NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={CPUS} "
                f"RealMemory={self.memory_mb} State=UNKNOWN",
                f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE "
                f"State=UP OverSubscribe=FORCE:{OVERSUBSCRIBE}",
                "",
            ]
        )

    def _spawn(self, name: str, *args: str) -> None:
        program = self.programs.get(name)
        if program is None:
            raise SlurmUnavailable(missing() or f"no {name}")
        out = (self.root / "log" / f"{name}.out").open("wb")
        try:
            self.procs[name] = subprocess.Popen(
                [program, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        finally:
            out.close()

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(0.2)

    def _idle(self) -> bool:
        result = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return result.returncode == 0 and f"{NODE} idle" in result.stdout

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client (by its name) against this cluster, to its end"""
        return subprocess.run(
            [self.programs[argv[0]], *argv[1:]],
            env=self.env(),
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job``: ``JobState``, ``ExitCode``, ... (empty once forgotten)"""
        result = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if result.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)

    def logs(self) -> str:
        """The daemons' log tails, for a failing test's message"""
        tails = []
        for path in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                tails.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-1500:])
        return "\n".join(tails)

    def cancel_all(self, timeout_s: float = 30.0) -> None:
        """``scancel`` every job and wait until none runs (slurmd's exit would orphan them)"""
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        self.run("scancel", "--full", "--partition", PARTITION, check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = self.run("squeue", "-h", "-t", "PD,R,CG,S", "-o", "%A", check=False)
            if listed.returncode != 0 or not listed.stdout.strip():
                return
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel what still runs, then stop slurmd, slurmctld and munged, each by its PID"""
        self.cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster`, stopped at the end whatever happens"""
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
