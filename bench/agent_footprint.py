"""
Footprint of one idle drone agent: resident memory and CPU, beside a bare NATS client

Starts its own nats-server (``EmbeddedServer``, loopback, temporary store),
then two processes:

* ``cobald-remote agent run --no-startd`` around a worker that only sleeps,
  with a heartbeat every ``--heartbeat`` seconds (default 30, the production
  default), and
* a bare Python interpreter that imports nats-py, connects and sleeps: the
  least any Python client on the bus costs.

After a warm-up it samples both over ``--window`` seconds (default 60) from
``/proc``: resident set size (VmRSS, and the peak VmHWM) and CPU time (all
threads, from ``schedstat`` in nanoseconds). It prints a table with the ratios
and writes JSON to ``bench/results/agent_footprint-<time>.json``. Linux only (``/proc``). Nothing is
asserted: this is a measurement.

Usage::

    python bench/agent_footprint.py            # 60 s window
    python bench/agent_footprint.py --quick    # 10 s window, heartbeat every 2 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import nats
import nats.js.errors

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.protocol.names import Namespace

RESULTS = Path(__file__).resolve().parent / "results"
DRONE = "bench-00000000ff"
SLEEPER = "import time; time.sleep(1e9)"
BARE_CLIENT = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1], name="bare-client")
    print("connected", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    rss_kib: int
    peak_kib: int
    cpu_s: float


@dataclass
class Footprint:
    """One process over the window"""

    rss_mib: float  #: resident memory at the end of the window
    peak_rss_mib: float  #: highest resident memory since the process started
    cpu_s: float  #: CPU time (user + system) spent during the window
    cpu_percent: float  #: of one core, averaged over the window


def sample(pid: int) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return Sample(
        rss_kib=int(fields["VmRSS"].split()[0]),
        peak_kib=int(fields["VmHWM"].split()[0]),
        cpu_s=cpu_time(pid),
    )


def cpu_time(pid: int) -> float:
    """CPU seconds of all threads: schedstat (nanoseconds), else stat (clock ticks)"""
    try:
        return (
            sum(
                int(task.joinpath("schedstat").read_text().split()[0])
                for task in Path(f"/proc/{pid}/task").iterdir()
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        after_name = stat[stat.rfind(b")") + 2 :].split()
        return (int(after_name[11]) + int(after_name[12])) / _TICKS  # utime, stime


def footprint(before: Sample, after: Sample, window_s: float) -> Footprint:
    cpu = after.cpu_s - before.cpu_s
    return Footprint(
        rss_mib=round(after.rss_kib / 1024, 2),
        peak_rss_mib=round(after.peak_kib / 1024, 2),
        cpu_s=round(cpu, 6),
        cpu_percent=round(100 * cpu / window_s, 5),
    )


async def start_agent(url: str, spool: Path, heartbeat_s: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "broker.cli",
        "agent",
        "run",
        "--no-startd",
        "--url",
        url,
        "--drone",
        DRONE,
        "--spool-dir",
        str(spool),
        "--heartbeat",
        str(heartbeat_s),
        "--log-level",
        "warning",
        "--",
        sys.executable,
        "-c",
        SLEEPER,
        stdin=asyncio.subprocess.DEVNULL,
    )


async def start_bare(url: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        BARE_CLIENT,
        url,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    if line.strip() != b"connected":
        raise RuntimeError(f"bare client did not connect: {line!r}")
    return proc


async def stop(proc: asyncio.subprocess.Process) -> int | None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return proc.returncode


async def measure(window_s: float, heartbeat_s: float, warmup_s: float) -> dict[str, object]:
    namespace = Namespace()
    with tempfile.TemporaryDirectory(prefix="agent-footprint-") as tmp:
        async with EmbeddedServer(Path(tmp) / "nats") as server:
            nc = await nats.connect(server.url)
            try:
                await provision(nc.jetstream())
                beats: list[float] = []

                async def count(msg: object) -> None:
                    beats.append(time.monotonic())

                await nc.subscribe(namespace.event("bench", DRONE, "heartbeat"), cb=count)
                agent = await start_agent(server.url, Path(tmp) / "spool", heartbeat_s)
                bare = await start_bare(server.url)
                try:
                    kv = await nc.jetstream().key_value(namespace.record_bucket)
                    deadline = time.monotonic() + 60
                    while True:  # the agent is up once it has claimed its record
                        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                            await kv.get(namespace.record_key("bench", DRONE))
                            break
                        if time.monotonic() > deadline or agent.returncode is not None:
                            raise RuntimeError("the agent did not come up")
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(warmup_s)
                    start = time.monotonic()
                    before = {"agent": sample(agent.pid), "bare": sample(bare.pid)}
                    beats.clear()
                    await asyncio.sleep(window_s)
                    after = {"agent": sample(agent.pid), "bare": sample(bare.pid)}
                    elapsed = time.monotonic() - start
                    heartbeats = len(beats)
                finally:
                    agent_status = await stop(agent)
                    await stop(bare)
            finally:
                await nc.close()
    result = {name: footprint(before[name], after[name], elapsed) for name in before}
    return {
        "what": "idle agent (--no-startd, sleeping worker) vs a bare nats-py client",
        "window_s": round(elapsed, 2),
        "heartbeat_s": heartbeat_s,
        "heartbeats_seen": heartbeats,
        "agent_exit_status": agent_status,
        "agent": asdict(result["agent"]),
        "bare_client": asdict(result["bare"]),
        "ratio": {
            "rss": round(result["agent"].rss_mib / result["bare"].rss_mib, 2),
            "cpu": round(result["agent"].cpu_s / result["bare"].cpu_s, 2)
            if result["bare"].cpu_s
            else None,
        },
        "environment": {
            "python": platform.python_version(),
            "nats-py": version("nats-py"),
            "msgspec": version("msgspec"),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_1min": round(os.getloadavg()[0], 2),
        },
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def table(result: dict[str, object]) -> str:
    agent, bare, ratio = result["agent"], result["bare_client"], result["ratio"]
    assert isinstance(agent, dict) and isinstance(bare, dict) and isinstance(ratio, dict)
    cpu_ratio = "n/a" if ratio["cpu"] is None else f"{ratio['cpu']:.1f}x"
    rows = [
        ("", "agent", "bare client", "ratio"),
        ("RSS (MiB)", f"{agent['rss_mib']:.1f}", f"{bare['rss_mib']:.1f}", f"{ratio['rss']:.2f}x"),
        ("peak RSS (MiB)", f"{agent['peak_rss_mib']:.1f}", f"{bare['peak_rss_mib']:.1f}", ""),
        ("CPU (ms)", f"{agent['cpu_s'] * 1e3:.1f}", f"{bare['cpu_s'] * 1e3:.1f}", cpu_ratio),
        ("CPU (% of a core)", f"{agent['cpu_percent']:.4f}", f"{bare['cpu_percent']:.4f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(
        f"window {result['window_s']} s, heartbeat every {result['heartbeat_s']} s, "
        f"{result['heartbeats_seen']} heartbeats seen"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured (60)")
    parser.add_argument("--heartbeat", type=float, default=30.0, help="agent heartbeat (30 s)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--quick", action="store_true", help="10 s window, 2 s heartbeat")
    parser.add_argument("--output", type=Path, help="JSON file (default bench/results/...)")
    args = parser.parse_args()
    if args.quick:
        args.window, args.heartbeat = 10.0, 2.0
    result = asyncio.run(measure(args.window, args.heartbeat, args.warmup))
    print(table(result))
    output = args.output or RESULTS / time.strftime("agent_footprint-%Y%m%dT%H%M%S.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
