"""One demo run: the emulated site, the real COBalD daemon, the drones' jobs"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from broker.emulation.demo.analysis import analyze
from broker.emulation.demo.scenario import Scenario
from broker.emulation.demo.template import bus_section, render_config
from broker.emulation.execution_point.install import DEPLOY_CONFIG, install_fake_condor
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE
from broker.emulation.groundtruth import GroundTruth, read_ground_truth
from broker.emulation.site.collector import install_fake_collector
from broker.emulation.site.lbs import Job, LocalBatchSystem
from broker.emulation.site.overlay import OverlayPool
from broker.emulation.site.schedd import install_fake_schedd

MODES = {"stock": "stock TARDIS", "remote": "with cobald-remote"}

Progress = Callable[[str], None]


def to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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


async def supervise(
    daemon: asyncio.subprocess.Process,
    mode: str,
    span: tuple[float, float],
    line: Callable[[], str],
    progress: Progress,
    every_s: float,
) -> bool:
    """Report ``line()`` every ``every_s`` from ``span[0]`` to ``span[1]``; whether it died"""
    start, end = span
    next_report = start
    while time.time() < end:
        if daemon.returncode is not None:
            return True
        if time.time() >= next_report:
            elapsed = max(0.0, time.time() - start)
            progress(f"[{mode:6} {elapsed:4.0f}s] {line()}")
            next_report += every_s
        await asyncio.sleep(0.5)
    return False


def daemon_died(daemon: asyncio.subprocess.Process, root: Path) -> RuntimeError:
    """The error of a run whose COBalD daemon exited early, with its log's end"""
    tail = (root / "daemon.log").read_text(errors="replace").splitlines()[-15:]
    return RuntimeError(
        f"the COBalD daemon exited with {daemon.returncode}; its log ends:\n" + "\n".join(tail)
    )


# ---------------------------------------------------------------------- the payloads


def overlay_pool(scenario: Scenario, root: Path, truth: GroundTruth) -> OverlayPool:
    """
    The run's overlay pool: an endless supply of payloads for the scripted demand, only
    those :func:`arriving` submits for COBalD's controller
    """
    endless = scenario.payload_duration if scenario.demand == "scripted" else None
    ad = scenario.payload_ad()
    return OverlayPool(root, endless, truth, ad=(lambda _: ad) if ad else None)


@contextlib.asynccontextmanager
async def arriving(overlay: OverlayPool, scenario: Scenario, start: float) -> AsyncIterator[None]:
    """
    While in the context, submit each payload of ``scenario.arrivals()`` to ``overlay`` at its
    time after ``start`` (epoch seconds), as ``1.0``, ``2.0``, ...; nothing for the scripted
    demand
    """
    if scenario.demand == "scripted":
        yield
        return

    async def submit() -> None:
        for index, (at, duration_s) in enumerate(scenario.arrivals()):
            await asyncio.sleep(max(0.0, start + at - time.time()))
            overlay.submit(f"{index + 1}.0", duration_s)

    task = asyncio.create_task(submit())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def numbers(scenario: Scenario, root: Path, end: float) -> dict[str, Any]:
    """The numbers of the run of ``scenario`` under ``root`` that ended at ``end``"""
    controlled = scenario.demand == "controller"
    return analyze(
        root,
        end,
        cores_per_drone=scenario.slots,
        controller_interval_s=scenario.controller_interval_s if controlled else None,
        end_rows=scenario.drones_end,
    )


# ---------------------------------------------------------------------- one run


class Live:
    """Counts for the progress line, read from the ground truth as it is written"""

    def __init__(self, root: Path, lbs: LocalBatchSystem, overlay: OverlayPool) -> None:
        self.root, self.lbs, self.overlay = root, lbs, overlay

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
        waiting = f", {self.overlay.idle} waiting" if self.overlay.payload_duration is None else ""
        return (
            f"drones {running} up, {queued} queued | payloads {started} started, "
            f"{finished} finished, {killed} killed{waiting}"
        )


async def run_mode(
    scenario: Scenario,
    mode: str,
    root: Path,
    *,
    nats_url: str | None = None,
    bus_keys: Mapping[str, Any] | None = None,
    progress: Progress = to_stderr,
    progress_every_s: float = 10.0,
) -> dict[str, Any]:
    """
    One run of ``scenario`` with stock TARDIS (``mode`` ``stock``) or with
    cobald-remote (``remote``, needs ``nats_url``); its numbers (``analysis.py``)

    :param bus_keys: more keys of the ``bus:`` section (credentials, the issuer)

    :raises RuntimeError: if the COBalD daemon dies during the run
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}")
    if mode == "remote" and not nats_url:
        raise ValueError("the run with cobald-remote needs a NATS URL")
    if scenario.tardis_adapters == "slurm":
        from broker.emulation.demo.slurm_run import run_slurm_mode

        return await run_slurm_mode(
            scenario,
            mode,
            root,
            nats_url=nats_url,
            bus_keys=bus_keys,
            progress=progress,
            every_s=progress_every_s,
        )
    os.makedirs(root, exist_ok=True)
    lbs_truth, obs_truth = GroundTruth(root / "lbs.jsonl"), GroundTruth(root / "obs.jsonl")
    overlay = overlay_pool(scenario, root, obs_truth)
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
    # room for the daemon to import before the schedule (or the first arrival) begins
    start = time.time() + 2.0
    bus = bus_section(scenario, nats_url, bus_keys) if mode == "remote" and nats_url else None
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
    live = Live(root, lbs, overlay)
    end = start + scenario.total_s
    try:
        async with arriving(overlay, scenario, start):
            died = await supervise(
                daemon, mode, (start, end), live.line, progress, progress_every_s
            )
    finally:
        await stop_daemon(daemon)
        finished = time.time()
        await overlay.close()
        await lbs.close()
        lbs_truth.close()
        obs_truth.close()
    if died:
        raise daemon_died(daemon, root)
    result = numbers(scenario, root, min(finished, end))
    progress(f"[{mode:6} done] {live.line()}")
    return result
