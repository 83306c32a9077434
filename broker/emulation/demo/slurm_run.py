"""
One demo run on a real Slurm: TARDIS's Slurm site adapter, the site of ``slurm_site.py``

Its one rule, as in ``run.py``: every process it starts is stopped by its PID (the cluster's
daemons by :class:`SlurmCluster`, the drone jobs by ``scancel`` before slurmd stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from broker.emulation.demo.analysis import SLURM_STATES
from broker.emulation.demo.run import (
    Progress,
    arriving,
    daemon_died,
    numbers,
    overlay_pool,
    start_daemon,
    stop_daemon,
    supervise,
)
from broker.emulation.demo.scenario import Scenario
from broker.emulation.demo.template import bus_section, render_config
from broker.emulation.groundtruth import GroundTruth, read_ground_truth
from broker.emulation.site.collector import install_fake_collector
from broker.emulation.site.slurm import KILL_WAIT_S, SlurmCluster
from broker.emulation.site.slurm_site import SlurmSite, slurm_environment


def slurm_counts(site: SlurmSite, end: float) -> dict[str, Any]:
    """What TARDIS asked of Slurm during the run: the rows the table adds"""
    calls = [call for call in site.calls() if call["t"] <= end]
    squeue = [float(call["wall_s"]) for call in calls if call["event"] == "squeue"]
    scancels = [call for call in calls if call["event"] == "scancel"]
    return {
        "sbatch calls": sum(1 for call in calls if call["event"] == "sbatch"),
        "squeue calls": len(squeue),
        "squeue wall time (s, total)": f"{sum(squeue):.1f}",
        "squeue wall time (ms, median)": f"{1000 * statistics.median(squeue):.0f}"
        if squeue
        else "-",
        "scancel of a queued job": sum(1 for c in scancels if c.get("state") == "PENDING"),
        "scancel of a running job": sum(1 for c in scancels if c.get("state") == "RUNNING"),
    }


@contextlib.asynccontextmanager
async def preempting(
    site: SlurmSite, scenario: Scenario, start: float, progress: Progress
) -> AsyncIterator[None]:
    """While in the context, preempt a running drone job at each of the scenario's times"""

    async def preempt() -> None:
        for index, at in enumerate(scenario.preemption_times()):
            await asyncio.sleep(max(0.0, start + at - time.time()))
            rng = random.Random(f"{scenario.seed}:preempt:{index}")
            job = await asyncio.to_thread(site.preempt, rng)
            progress(f"the site preempts job {job}" if job else "no drone job to preempt")
            if job is not None:
                await asyncio.sleep(KILL_WAIT_S)
                await asyncio.to_thread(site.kill_preempted, job)

    task = asyncio.create_task(preempt())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _line(site: SlurmSite) -> str:
    entries = read_ground_truth(site.truth_file)
    started = sum(1 for e in entries if e["event"] == "job_started")
    ended = sum(1 for e in entries if e["event"] == "job_exited")
    submitted = sum(1 for e in entries if e["event"] == "job_submitted")
    polls = sum(1 for call in site.calls("squeue"))
    return f"Slurm jobs {submitted} submitted, {started} started, {ended} ended | squeue {polls}"


async def run_slurm_mode(
    scenario: Scenario,
    mode: str,
    root: Path,
    *,
    nats_url: str | None,
    bus_keys: Mapping[str, Any] | None,
    progress: Progress,
    every_s: float,
) -> dict[str, Any]:
    """
    :func:`broker.emulation.demo.run.run_mode` with a real Slurm as the site

    :raises SlurmUnavailable: if the cluster cannot start
    :raises RuntimeError: if the COBalD daemon dies during the run
    """
    os.makedirs(root, exist_ok=True)
    cluster = SlurmCluster(root / "slurm")
    try:
        await asyncio.to_thread(cluster.start)
    except BaseException:
        await asyncio.to_thread(cluster.stop)  # what started before the failure
        raise
    obs_truth = GroundTruth(root / "obs.jsonl")
    overlay = overlay_pool(scenario, root, obs_truth)
    site = SlurmSite(
        cluster,
        root,
        mode=mode,
        slots=scenario.slots,
        agent_heartbeat_s=scenario.agent_heartbeat_s,
        agent_poll_s=scenario.agent_poll_s,
        end_grace_s=10.0,
    )
    died = False
    try:
        site.write()
        await overlay.start()
        start = time.time() + 2.0  # room for the daemon to import before the schedule begins
        bus = bus_section(scenario, nats_url, bus_keys) if mode == "remote" and nats_url else None
        config = root / "cobald.yaml"
        config.write_text(render_config(scenario, root, start=start, bus=bus))
        env = slurm_environment(
            site, install_fake_collector(root / "collector-bin", overlay.socket)
        )
        end = start + scenario.total_s
        async with site.following(overlay):
            daemon = await start_daemon(config, root / "daemon.log", env)
            progress(f"[{mode:6}] COBalD daemon pid {daemon.pid}, Slurm in {cluster.root}")
            try:
                async with (
                    arriving(overlay, scenario, start),
                    preempting(site, scenario, start, progress),
                ):
                    died = await supervise(
                        daemon, mode, (start, end), lambda: _line(site), progress, every_s
                    )
            finally:
                await stop_daemon(daemon)
                finished = time.time()
                await asyncio.to_thread(cluster.cancel_all)
                # how each job ended, in Slurm's words: TIMEOUT tells a kill at its walltime
                states = await asyncio.to_thread(site.final_states)
                (root / SLURM_STATES).write_text(json.dumps(states))
    finally:
        await overlay.close()
        obs_truth.close()
        await asyncio.to_thread(cluster.stop)
    if died:
        raise daemon_died(daemon, root)
    result = numbers(scenario, root, min(finished, end))
    result["slurm"] = slurm_counts(site, min(finished, end))
    progress(f"[{mode:6} done] {_line(site)}")
    return result
