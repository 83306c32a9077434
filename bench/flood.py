"""
Flood benchmark: one drone publishing as fast as it can while 100 honest drones run

Run from the repository root::

    python bench/flood.py                 # 20 s baseline, 10 s flood, 20 s after; < 2 min
    python bench/flood.py --quick         # 8 s, 10 s, 8 s

A real nats-server in operator mode (``broker/server/auth/``: every drone on its own
credentials, the account and drone limits of ``docs/deployment.md#limits``),
the streams as ``broker init`` makes them (per-subject cap, size cap), and the
real :class:`~broker.manager.service.ManagerService` in this process. ``--drones``
honest drones (default 100), each on its own connection and credentials,
publish what an agent publishes: a heartbeat every ``--heartbeat`` seconds
(default 2) and now and then a payload start or end, each awaiting its PubAck.
The flooding drone runs in a subprocess (so that its loop does not share the
manager's) on its own credentials and publishes for ``--flood`` seconds as fast
as its connection takes it, without waiting for acks: valid heartbeats and
payload starts of its own with ever higher ``seq``, garbage bodies, bodies
naming another drone, deeply nested fields, and subjects of made-up kinds
(which the server refuses).

Measured for the honest drones: each event's time from publish to the moment
the manager's registry shows it (``service.registry.view(site, drone)``, polled
every 5 ms, matched by the view's ``encoded`` bytes), p50/p99/max per phase, the
flood and after phases as ratios to the baseline; and the RSS of this process
(the manager and the honest drones' clients) and of the nats-server, sampled
every 0.5 s. Writes JSON to ``bench/results/flood-<time>.json``. Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
from _common import percentiles
from _flood_drones import FLOODER, NS, SITE, Honest, flooder, honest_loop

from broker.manager.service import ManagerService, ManagerSettings
from broker.server.auth.authority import create_authority
from broker.server.auth.credentials import drone_credentials, manager_credentials
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.protocol.connect import connect


async def watch(
    service: ManagerService,
    drones: list[Honest],
    samples: list[tuple[float, float]],
    stop: asyncio.Event,
) -> None:
    """Note (sent, latency) for every honest event once the registry shows it"""
    while not stop.is_set():
        now = time.perf_counter()
        for drone in drones:
            if not drone.pending:
                continue
            view = service.registry.view(SITE, drone.name)
            found = drone.pending.get(view.encoded) if view and view.encoded else None
            if found is None:
                continue
            index = found[0]
            for data, (i, sent) in list(drone.pending.items()):
                if i <= index:
                    del drone.pending[data]
                    samples.append((sent, now - sent))
        await asyncio.sleep(0.005)


def rss_mb(pid: int | None = None) -> float:
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def sample_rss(
    pid: int | None, out: list[tuple[float, float, float]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        out.append((time.perf_counter(), rss_mb(), rss_mb(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


# ------------------------------------------------------------------------ the run


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(10)
    authority = create_authority()
    with tempfile.TemporaryDirectory(prefix="cobald-remote-flood-") as tmp_name:
        tmp = Path(tmp_name)
        config = tmp / "server.conf"
        config.write_text(
            f'jetstream {{ store_dir: "{tmp / "js"}" }}\n' + authority.server_config()
        )
        (tmp / "manager.creds").write_text(manager_credentials(authority))
        # the manager logs as in a deployment (INFO, to a file): what that costs is measured
        log_file = tmp / "manager.log"
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        async with EmbeddedServer(tmp / "nats", config_file=config) as server:
            admin = await connect(server.url, user_credentials=str(tmp / "manager.creds"))
            await provision(admin.jetstream())
            service = ManagerService(
                ManagerSettings(servers=[server.url], creds=str(tmp / "manager.creds"), retry_s=0.5)
            )
            service_task = asyncio.create_task(service.run())
            await asyncio.wait_for(service.ready.wait(), 60)

            drones: list[Honest] = []
            for i in range(args.drones):
                name = _common.drone_name(SITE, i + 1)
                creds = tmp / f"{name}.creds"
                creds.write_text(drone_credentials(authority, NS, SITE, name))
                nc = await connect(
                    server.url, user_credentials=str(creds), inbox_prefix=f"_INBOX_{name}"
                )
                drones.append(Honest(name, nc, 1_000_000, random.Random(rng.random())))
            flood_creds = tmp / "flooder.creds"
            flood_creds.write_text(drone_credentials(authority, NS, SITE, FLOODER))

            stop = asyncio.Event()
            samples: list[tuple[float, float]] = []
            rss: list[tuple[float, float, float]] = []
            tasks = [asyncio.create_task(honest_loop(d, args.heartbeat, stop)) for d in drones]
            tasks.append(asyncio.create_task(watch(service, drones, samples, stop)))
            tasks.append(asyncio.create_task(sample_rss(server.pid, rss, stop)))

            start = time.perf_counter()
            await asyncio.sleep(args.baseline)
            flood_start = time.perf_counter()
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--flooder",
                server.url,
                str(flood_creds),
                str(args.flood),
                stdout=subprocess.PIPE,
            )
            out, _ = await process.communicate()
            flood_end = time.perf_counter()
            await asyncio.sleep(args.after)
            end = time.perf_counter()
            stop.set()
            await asyncio.gather(*tasks)
            info = await admin.jetstream().stream_info(
                NS.event_stream, subjects_filter=f"{NS.drone_root(SITE, FLOODER)}.>"
            )
            metrics = service.registry.metrics()
            for drone in drones:
                await drone.nc.close()
            service.stop()
            await asyncio.wait_for(service_task, 30)
            await admin.close()
            logging.getLogger().removeHandler(handler)
            handler.close()
            log_lines = len(log_file.read_text().splitlines())

    def phase(lo: float, hi: float) -> dict[str, float]:
        return percentiles([lat for sent, lat in samples if lo <= sent < hi])

    def memory(lo: float, hi: float) -> dict[str, float]:
        picked = [(own, srv) for t, own, srv in rss if lo <= t < hi] or [(0.0, 0.0)]
        return {
            "manager_rss_mb": max(own for own, _ in picked),
            "server_rss_mb": max(srv for _, srv in picked),
        }

    unapplied = sum(len(d.pending) for d in drones)
    return {
        "args": vars(args),
        "flooder_sent": int(out.decode().strip() or 0),
        "flood_s": round(flood_end - flood_start, 2),
        "phases": {
            "baseline": {**phase(start, flood_start), **memory(start, flood_start)},
            "flood": {**phase(flood_start, flood_end), **memory(flood_start, flood_end)},
            "after": {**phase(flood_end, end), **memory(flood_end, end)},
        },
        "honest_published": sum(d.published for d in drones),
        "honest_unapplied_at_end": unapplied,
        "flooder_kept_in_stream": dict(info.state.subjects or {}),
        "stream_messages": info.state.messages,
        "stream_bytes": info.state.bytes,
        "registry_rejected": metrics.rejected_total,
        "manager_log_lines": log_lines,
    }


def render(report: dict[str, object]) -> str:
    phases = report["phases"]
    assert isinstance(phases, dict)
    base = phases["baseline"]
    rows = []
    for name in ("baseline", "flood", "after"):
        p = phases[name]
        ratio = "" if name == "baseline" else f"{p['p99_ms'] / base['p99_ms']:.2f}"
        mem = "" if name == "baseline" else f"{p['manager_rss_mb'] / base['manager_rss_mb']:.2f}"
        rows.append(
            [
                name,
                p["count"],
                p["p50_ms"],
                p["p99_ms"],
                p["max_ms"],
                ratio,
                p["manager_rss_mb"],
                mem,
                p["server_rss_mb"],
            ]
        )
    header = ["phase", "events", "p50 ms", "p99 ms", "max ms", "p99/base", "manager MB", "/base"]
    lines = [
        _common.table([*header, "server MB"], rows),
        "",
        f"flooder: {report['flooder_sent']:,} messages in {report['flood_s']} s; kept in the "
        f"stream: {report['flooder_kept_in_stream']}",
        f"registry rejected {report['registry_rejected']:,}; honest events published "
        f"{report['honest_published']:,}, not applied at the end "
        f"{report['honest_unapplied_at_end']}; manager log lines {report['manager_log_lines']:,}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--flooder"]:
        url, creds, duration = argv[1:4]
        asyncio.run(flooder(url, creds, float(duration)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drones", type=int, default=100, help="honest drones (default 100)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="seconds between events")
    parser.add_argument("--baseline", type=float, default=20.0, help="seconds before the flood")
    parser.add_argument("--flood", type=float, default=10.0, help="seconds of flood")
    parser.add_argument("--after", type=float, default=20.0, help="seconds after the flood")
    parser.add_argument("--quick", action="store_true", help="8 s before and after")
    parser.add_argument("--out", type=Path, help="directory for the JSON (bench/results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.baseline = args.after = 8.0
    budget = args.baseline + args.flood + args.after + 120
    report = _common.run_bounded(run(args), budget)
    print(render(report))
    print(f"written to {_common.write_result('flood', report, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
