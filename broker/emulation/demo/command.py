"""
``cobald-remote demo``: the report's conditions, stock TARDIS against TARDIS with cobald-remote

One run (see ``docs/tardis.md``, "The demonstration"):

1. the embedded broker (``broker.server.embedded.EmbeddedServer``), provisioned;
2. an emulated local batch system (``lbs.py``) that starts each drone job as a
   local process tree after the scenario's queue delay, and an emulated
   overlay pool (``overlay.py``) that offers short payloads to every startd;
3. the **real COBalD daemon** (``python -m cobald.daemon``) with **real TARDIS**,
   configured from ``deploy/cobald/demo.yaml``: a schedule of strongly swinging
   demand, TARDIS's pool built by ``!RemoteTardisPoolFactory``, adapters whose
   views lag like a cached ``condor_q`` and ``condor_status``;
4. each drone job runs the real agent (``cobald-remote agent run -- condor_master -f``)
   around an emulated startd that runs payloads through the real gate hooks
   (with cobald-remote), or the emulated startd alone (stock);
5. at the end, the numbers from the emulators' own records (``analysis.py``).

``--compare`` runs the same seeded scenario with stock TARDIS first. Every
process started here is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import string
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors

from broker.emulation.demo.analysis import analyze
from broker.emulation.demo.scenario import Scenario
from broker.emulation.execution_point.install import DEPLOY_CONFIG, install_fake_condor
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE
from broker.emulation.groundtruth import GroundTruth, read_ground_truth
from broker.emulation.site.collector import install_fake_collector
from broker.emulation.site.lbs import Job, LocalBatchSystem
from broker.emulation.site.overlay import OverlayPool
from broker.emulation.site.schedd import install_fake_schedd
from broker.manager.timeline import format_table, read_timeline
from broker.server.embedded import EmbeddedServer
from broker.server.provision import Topology, provision
from remote_agent.protocol.connect import connect
from remote_agent.protocol.events import Namespace, SchemaError, decode_record

#: the COBalD/TARDIS configuration the demo fills in for each run
CONFIG_TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "cobald" / "demo.yaml"
#: the drone job TARDIS's HTCondor site adapter submits (``--tardis-adapters htcondor``)
DEPLOY_JDL = CONFIG_TEMPLATE.with_name("drone.jdl")
MODES = {"stock": "stock TARDIS", "remote": "with cobald-remote"}

Progress = Callable[[str], None]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- configuration


def render_config(
    scenario: Scenario,
    root: Path,
    *,
    start: float,
    bus: Mapping[str, Any] | None,
    template: Path = CONFIG_TEMPLATE,
) -> str:
    """``deploy/cobald/demo.yaml`` filled in for one run under ``root``"""
    values = {
        "schedule": json.dumps(scenario.schedule()),
        "start": repr(start),
        "pool_interval": repr(scenario.pool_interval_s),
        "bus": json.dumps(dict(bus)) if bus is not None else "null",
        "recorder": str(root / "tardis.jsonl"),
        "quota": str(scenario.max_drones * scenario.slots * 3),
        "heartbeat": str(int(scenario.heartbeat_s)),
        **{key: json.dumps(value) for key, value in _adapters(scenario, root).items()},
    }
    return string.Template(template.read_text()).substitute(values)


def _adapters(scenario: Scenario, root: Path) -> dict[str, Any]:
    """The adapter parts of the ``tardis:`` section for ``scenario.tardis_adapters``"""
    meta = {"drone": {"Cores": scenario.slots, "Memory": 2, "Disk": 4}}
    if scenario.tardis_adapters == "htcondor":
        return {
            "batch_system": {
                "adapter": "HTCondor",
                "max_age": scenario.batch_max_age_s / 60,  # minutes
                "ratios": {"cpu_ratio": "Real(TotalSlotCpus-Cpus)/TotalSlotCpus"},
            },
            "site_adapter": "HTCondor",
            "site_section": {
                "MachineTypes": ["drone"],
                "MachineTypeConfiguration": {"drone": {"jdl": str(DEPLOY_JDL)}},
                "MachineMetaData": meta,
                "bulk_delay": 0.1,
            },
        }
    if scenario.tardis_adapters != "emulated":
        raise ValueError(
            f"tardis_adapters must be emulated or htcondor, not {scenario.tardis_adapters!r}"
        )
    return {
        "batch_system": {
            "adapter": "broker.emulation.site.tardis_adapters:OverlayBatchSystemAdapter",
            "socket": str(root / "obs.sock"),
            "max_age": scenario.batch_max_age_s,  # seconds
        },
        "site_adapter": "broker.emulation.site.tardis_adapters:LocalBatchSiteAdapter",
        "site_section": {
            "socket": str(root / "lbs.sock"),
            "max_age": scenario.site_max_age_s,  # seconds
            "MachineTypes": ["drone"],
            "MachineTypeConfiguration": {"drone": {}},
            "MachineMetaData": meta,
        },
    }


def bus_section(scenario: Scenario, url: str) -> dict[str, Any]:
    return {
        "servers": url,
        "lost_after_s": scenario.lost_after_s,
        "drain_deadline_s": 600.0,
        "lost_removal_after_s": 600.0,
        "request_timeout_s": 2.0,
    }


def agent_command() -> list[str]:
    script = Path(sys.executable).parent / "cobald-remote"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "broker.cli"]


def launcher(scenario: Scenario, mode: str) -> Callable[[Job], tuple[list[str], dict[str, str]]]:
    """What each drone job runs: the agent around the emulated startd, or the startd alone"""

    def launch(job: Job) -> tuple[list[str], dict[str, str]]:
        bin_dir, state_dir = job.sandbox / "bin", job.sandbox / "ep"
        host = f"{job.drone}.demo"
        if mode == "remote":
            env = install_fake_condor(
                bin_dir, state_dir, slots=scenario.slots, host=host, deploy_config=DEPLOY_CONFIG
            )
            argv = [
                *agent_command(),
                "agent",
                "run",
                "--log-format=text",
                f"--heartbeat={scenario.agent_heartbeat_s}",
                f"--poll={scenario.agent_poll_s}",
                "--end-grace=10",
                "--kill-after=5",
                f"--spool-dir={job.sandbox / 'spool'}",
                "--",
                "condor_master",
                "-f",
            ]
        else:
            # a stock drone: the startd alone; graceful drains let payloads finish
            env = install_fake_condor(
                bin_dir,
                state_dir,
                slots=scenario.slots,
                host=host,
                deploy_config=None,
                extra_config={"MAXJOBRETIREMENTTIME": "10000000"},
            )
            argv = ["condor_master", "-f"]
        env.update(job.env)  # TardisDroneUuid and what the decorators add
        return argv, env

    return launch


# ---------------------------------------------------------------------- the daemon


def _default_sigint() -> None:  # a shell may have left SIGINT ignored for background jobs
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def start_daemon(
    config: Path, log_path: Path, env: Mapping[str, str] | None = None
) -> asyncio.subprocess.Process:
    """The real COBalD daemon, ``python -m cobald.daemon CONFIG``"""
    with log_path.open("ab") as log_file:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cobald.daemon",
            str(config),
            env=None if env is None else dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )


async def stop_daemon(proc: asyncio.subprocess.Process, timeout_s: float = 15.0) -> None:
    """SIGINT (COBalD's clean stop), then SIGKILL, by PID"""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# ---------------------------------------------------------------------- one run


class Live:
    """Counts for the progress line, read from the ground truth as it is written"""

    def __init__(self, root: Path, lbs: LocalBatchSystem) -> None:
        self.root, self.lbs = root, lbs

    def line(self) -> str:
        queued = running = 0
        for job in self.lbs.jobs.values():
            if job.ended is None and not job.removed:
                if job.started is None:
                    queued += 1
                else:
                    running += 1
        started = finished = killed = 0
        for job in self.lbs.jobs.values():
            if job.started is None:
                continue
            live: set[str] = set()
            for entry in read_ground_truth(job.sandbox / "ep" / GROUND_TRUTH_FILE):
                event = entry["event"]
                if event == "payload_started":
                    started += 1
                    live.add(entry["job_id"])
                elif event == "payload_finished":
                    finished += 1
                    live.discard(entry["job_id"])
                elif event == "payload_killed":
                    killed += 1
                    live.discard(entry["job_id"])
            if job.ended is not None:
                killed += len(live)
        return (
            f"drones {running} up, {queued} queued | payloads {started} started, "
            f"{finished} finished, {killed} killed"
        )


async def run_mode(
    scenario: Scenario,
    mode: str,
    root: Path,
    *,
    nats_url: str | None = None,
    progress: Progress = _stderr,
    progress_every_s: float = 10.0,
) -> dict[str, Any]:
    """
    One run of ``scenario`` with stock TARDIS (``mode`` ``stock``) or with
    cobald-remote (``remote``, needs ``nats_url``); its numbers (``analysis.py``)

    :raises RuntimeError: if the COBalD daemon dies during the run
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}")
    if mode == "remote" and not nats_url:
        raise ValueError("the run with cobald-remote needs a NATS URL")
    os.makedirs(root, exist_ok=True)
    lbs_truth, obs_truth = GroundTruth(root / "lbs.jsonl"), GroundTruth(root / "obs.jsonl")
    overlay = OverlayPool(root, scenario.payload_duration, obs_truth)
    lbs = LocalBatchSystem(
        root,
        launcher(scenario, mode),
        scenario.queue_delay,
        lbs_truth,
        vacate_s=scenario.vacate_s,
        on_start=lambda job: overlay.join(job.drone, job.sandbox / "ep"),
        on_end=lambda job: overlay.leave(job.drone),
    )
    await overlay.start()
    await lbs.start()
    start = time.time() + 2.0  # the daemon imports for about a second
    bus = bus_section(scenario, nats_url) if mode == "remote" and nats_url else None
    config = root / "cobald.yaml"
    config.write_text(render_config(scenario, root, start=start, bus=bus))
    env = None
    if scenario.tardis_adapters == "htcondor":  # TARDIS's ShellExecutor finds the fakes
        tools = [
            install_fake_schedd(root / "schedd-bin", lbs.socket),
            install_fake_collector(root / "collector-bin", overlay.socket),
        ]
        env = {**os.environ, "PATH": os.pathsep.join([*map(str, tools), os.environ["PATH"]])}
    daemon = await start_daemon(config, root / "daemon.log", env)
    progress(f"[{mode:6}] COBalD daemon pid {daemon.pid}, files in {root}")
    live = Live(root, lbs)
    end = start + scenario.total_s
    died = False
    try:
        next_report = start
        while time.time() < end:
            if daemon.returncode is not None:
                died = True
                break
            if time.time() >= next_report:
                elapsed = max(0.0, time.time() - start)
                progress(f"[{mode:6} {elapsed:4.0f}s] {live.line()}")
                next_report += progress_every_s
            await asyncio.sleep(0.5)
    finally:
        await stop_daemon(daemon)
        finished = time.time()
        await overlay.close()
        await lbs.close()
        lbs_truth.close()
        obs_truth.close()
    if died:
        tail = (root / "daemon.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(
            f"the COBalD daemon exited with {daemon.returncode}; its log ends:\n" + "\n".join(tail)
        )
    result = analyze(root, min(finished, end))
    progress(f"[{mode:6} done] {live.line()}")
    return result


# ---------------------------------------------------------------------- bus extras


async def record_outcomes(url: str, namespace: Namespace) -> dict[str, int]:
    """How each drone's handshake record ended: ``phase (writer)`` -> drones"""
    counts: dict[str, int] = {}
    nc = await connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        kv = await nc.jetstream().key_value(namespace.record_bucket)
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return counts
        for key in keys:
            entry = await kv.get(key)
            if entry.value is None:
                continue
            try:
                record = decode_record(entry.value)
            except SchemaError:
                continue
            label = f"{record.phase} ({record.writer})"
            counts[label] = counts.get(label, 0) + 1
    finally:
        await nc.close()
    return dict(sorted(counts.items()))


def interesting_drone(root: Path) -> str | None:
    """A drone TARDIS wanted to clean up while it was already running, else any with payloads"""
    started: dict[str, float] = {}
    for entry in read_ground_truth(root / "lbs.jsonl"):
        if entry["event"] == "job_started":
            started[entry["drone"]] = entry["t"]
    candidates: list[str] = []
    for entry in read_ground_truth(root / "tardis.jsonl"):
        drone = entry["drone"]
        if entry["state"] == "CleanupState" and drone in started and started[drone] < entry["t"]:
            candidates.append(drone)
    if candidates:
        return candidates[0]
    return next(iter(started), None)


async def sample_timeline(url: str, namespace: Namespace, drone: str) -> str:
    nc = await connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        rows = await read_timeline(nc, namespace, drone)
    finally:
        await nc.close()
    return format_table(rows)


# ---------------------------------------------------------------------- the table


def _rows(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for section in ("drones", "payloads"):
        for key, value in result[section].items():
            rows.append((f"{section}: {key}", str(value)))
    latency = result["tardis_latency"]
    if "median_s" in latency:
        text = f"{latency['median_s']:.1f} / {latency['p90_s']:.1f} / {latency['max_s']:.1f}"
    else:
        text = "-"
    rows.append(("TARDIS saw a started drone running after (s, median/p90/max)", text))
    rows.append(("started drones TARDIS never saw running", str(latency["never_seen_running"])))
    cleanup = result["tardis_transitions"].get("Booting->Cleanup", 0)
    rows.append(
        ("TARDIS Booting->Cleanup (demand fell while queued, as TARDIS saw it)", str(cleanup))
    )
    for label, count in result.get("handshake_records", {}).items():
        rows.append((f"handshake record: {label}", str(count)))
    return rows


def table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The final table, one column per run"""
    modes = list(results)
    columns = [dict(_rows(results[mode])) for mode in modes]
    labels: list[str] = []
    for mode in modes:
        for label, _ in _rows(results[mode]):
            if label not in labels:
                labels.append(label)
    header = ["", *(MODES[mode] for mode in modes)]
    lines = [header] + [[label, *(col.get(label, "-") for col in columns)] for label in labels]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in lines
    )


# ---------------------------------------------------------------------- the command


async def demo(
    scenario: Scenario,
    modes: Sequence[str],
    root: Path,
    *,
    progress: Progress = _stderr,
) -> dict[str, Any]:
    """Run ``modes`` in turn on one embedded broker; the results by mode"""
    results: dict[str, Any] = {}
    server = EmbeddedServer(root / "nats")
    namespace = Namespace()
    await server.start()
    try:
        nc = await connect(server.url, connect_timeout=2)
        try:
            await provision(nc.jetstream(), Topology(namespace=namespace))
        finally:
            await nc.close()
        progress(f"embedded broker {server.url} (pid {server.pid})")
        for mode in modes:
            progress(f"--- {MODES[mode]}: seed {scenario.seed}, {scenario.total_s:.0f}s")
            result = await run_mode(scenario, mode, root / mode, nats_url=server.url)
            if mode == "remote":
                result["handshake_records"] = await record_outcomes(server.url, namespace)
                drone = interesting_drone(root / mode)
                if drone is not None:
                    result["sample_drone"] = drone
                    result["sample_timeline"] = await sample_timeline(server.url, namespace, drone)
            results[mode] = result
    finally:
        await server.stop()
    return results


def main(args: argparse.Namespace) -> int:
    """``cobald-remote demo`` (``broker/cli.py`` parses the options)"""
    scenario = Scenario(
        seed=args.seed,
        duration_s=args.duration,
        max_drones=args.drones,
        tardis_adapters=args.tardis_adapters,
    )
    modes = ["stock", "remote"] if args.compare else ["remote"]
    keep = args.workdir is not None
    root = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="cobald-remote-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    _stderr(
        f"cobald-remote demo: seed {scenario.seed}, up to {scenario.max_drones} drones of "
        f"{scenario.slots} slots, demand swings for {scenario.duration_s:.0f}s "
        f"then {scenario.cooldown_s:.0f}s at zero; schedule {scenario.schedule()}"
    )
    try:
        results = asyncio.run(demo(scenario, modes, root))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    for mode, result in results.items():
        reasons = ", ".join(f"{k}: {v}" for k, v in result["kill_reasons"].items()) or "none"
        print(f"\n{MODES[mode]}: payloads killed by {reasons}")
    remote = results.get("remote", {})
    if "sample_timeline" in remote:
        print(f"\ntimeline of {remote['sample_drone']} (cobald-remote timeline DRONE):")
        print(remote["sample_timeline"])
    if args.json:
        document = {"scenario": scenario.describe(), "runs": results}
        Path(args.json).write_text(json.dumps(document, indent=2, default=str) + "\n")
    return 0
