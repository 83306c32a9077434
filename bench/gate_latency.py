"""
Gate latency on a slow scratch disk: a start hook's question to the agent's yes, p50/p99

Run from the repository root::

    .venv/bin/python bench/gate_latency.py            # 40 starts per disk, about 5 min
    .venv/bin/python bench/gate_latency.py --quick    # 10 starts per disk, < 1 min

It starts its own nats-server (the embedded one, in a temporary directory) and, for each
disk, one real in-process :class:`~remote_agent.agent.Agent` (no startd, a sleeping worker)
with its gate socket, heartbeating every ``--heartbeat`` s (0.05) so that events are
published, acknowledged and compacted away all the time. The disks: the normal one (the
baseline, measured in the same run), then the same disk with every ``fsync`` of the spool
made slower by 50 ms and by 1 s (``remote_agent.spool_disk.fsync`` wrapped, the way the
tests do it). The hook's side is the hook's own blocking client
(:func:`remote_agent.gate.client.ask`, from a thread); each start is followed by its
``JOB_EXIT``, one start at a time, ``--gap`` s apart. A yes waits until the payload's
start event is fsynced.

It prints, per disk, the start answer's p50/p99/max and the longest stall of the agent's
event loop (a task sleeping in 10 ms steps), with the ratios to the normal disk, beside the
hook's budget (5 s), and writes JSON to ``bench/results/gate_latency-<time>.json``.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import nats
from _common import percentiles

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent import spool_disk
from remote_agent.agent import Agent
from remote_agent.gate.client import ask
from remote_agent.gate.messages import GateDecisionReply, JobExitRequest, PrepareJobRequest
from remote_agent.gate.server import GateServer
from remote_agent.hooks import DEFAULT_TIMEOUT_S
from remote_agent.protocol.events import PayloadEnd
from remote_agent.settings import Settings

SITE = "bench"
#: extra seconds per fsync of each disk; the first is the baseline
DISKS = (("normal", 0.0), ("fsync +50 ms", 0.05), ("fsync +1 s", 1.0))


def _slowed(delay_s: float) -> Any:
    def fsync(fd: int) -> None:
        time.sleep(delay_s)
        os.fsync(fd)

    return fsync


async def _lag(worst: list[float], step_s: float = 0.01) -> None:
    while True:
        before = time.monotonic()
        await asyncio.sleep(step_s)
        worst[0] = max(worst[0], time.monotonic() - before - step_s)


async def _one_disk(
    url: str, tmp: Path, drone: str, delay_s: float, args: argparse.Namespace
) -> dict[str, Any]:
    spool_disk.fsync = _slowed(delay_s) if delay_s else os.fsync
    settings = Settings(
        site=SITE,
        drone=drone,
        servers=(url,),
        worker_command=(sys.executable, "-c", "import time; time.sleep(3600)"),
        spool_dir=tmp / f"spool-{delay_s}",
        gate_socket=tmp / f"gate-{delay_s}.sock",
        startd=False,
        heartbeat_s=args.heartbeat,
        end_grace_s=0.2,
        publish_timeout_s=2.0,
        reconnect_wait_s=0.1,
    )
    settings.validate()
    agent = Agent(settings)
    gate = GateServer(settings.gate_socket, agent)
    await gate.start()
    run = asyncio.create_task(agent.run())
    samples: list[float] = []
    refused = 0
    worst = [0.0]
    try:
        for _ in range(600):
            if agent.gate_open:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the agent's gate did not open within 30 s")
        await asyncio.sleep(args.gap)
        probe = asyncio.create_task(_lag(worst))
        spool = agent.emitter.spool
        assert spool is not None
        syncs = spool.syncs
        for n in range(args.starts):
            job = f"{n}.0"
            before = time.monotonic()
            reply = await asyncio.to_thread(
                ask, gate.path, PrepareJobRequest(job_id=job, slot="slot1_1"), DEFAULT_TIMEOUT_S
            )
            if isinstance(reply, GateDecisionReply) and reply.allow:
                samples.append(time.monotonic() - before)
            else:
                refused += 1
            await asyncio.to_thread(
                ask, gate.path, JobExitRequest(job_id=job, how=PayloadEnd.EXIT), DEFAULT_TIMEOUT_S
            )
            await asyncio.sleep(args.gap)
        probe.cancel()
        syncs = spool.syncs - syncs
    finally:
        agent.request_stop()
        await asyncio.wait_for(run, 60)
        await gate.close()
        spool_disk.fsync = os.fsync
    return {
        "fsync_delay_s": delay_s,
        "start": percentiles(samples),
        "refused": refused,
        "loop_stall_ms": worst[0] * 1e3,
        "fsyncs": syncs,
        "published": agent.publisher.published if agent.publisher else 0,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cobald-remote-gate-") as name:
        tmp = Path(name)
        async with EmbeddedServer(tmp / "nats") as server:
            async with await nats.connect(server.url) as nc:
                await provision(nc.jetstream())
            results = {}
            for i, (label, delay_s) in enumerate(DISKS):
                # a drone per disk: an ended drone's record keeps a new agent's gate shut
                drone = f"{SITE}-{i + 1:010x}"
                results[label] = await _one_disk(server.url, tmp, drone, delay_s, args)
                print(f"  {label}: done", file=sys.stderr)
    return {"disks": results, "starts": args.starts, "heartbeat_s": args.heartbeat}


def _report(report: dict[str, Any]) -> str:
    disks = report["disks"]
    base = disks[DISKS[0][0]]
    rows = []
    for label, result in disks.items():
        start = result["start"]
        rows.append(
            (
                label,
                start["count"],
                result["refused"],
                start["p50_ms"],
                start["p99_ms"],
                start["max_ms"],
                start["p99_ms"] / base["start"]["p99_ms"],
                result["loop_stall_ms"],
                result["fsyncs"],
            )
        )
    header = (
        "disk",
        "starts",
        "refused",
        "p50 ms",
        "p99 ms",
        "max ms",
        "p99 / normal",
        "loop stall ms",
        "fsyncs",
    )
    budget = f"the hook's budget: {DEFAULT_TIMEOUT_S * 1e3:,.0f} ms"
    return _common.table(header, rows) + "\n" + budget


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=40, help="starts per disk (40)")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between starts (0.3)")
    parser.add_argument("--heartbeat", type=float, default=0.05, help="agent heartbeat (0.05 s)")
    parser.add_argument("--quick", action="store_true", help="10 starts per disk")
    args = parser.parse_args()
    if args.quick:
        args.starts = 10
    budget_s = 60 + len(DISKS) * args.starts * (args.gap + 2 * DEFAULT_TIMEOUT_S)
    report = _common.run_bounded(measure(args), budget_s)
    print(_report(report))
    path = _common.write_result("gate_latency", report)
    print(f"written to {path.relative_to(_common.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
