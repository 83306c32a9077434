"""
Issuance benchmark: bootstrapped drone identities per second, and their latency

Run from the repository root::

    .venv/bin/python bench/issuance.py               # 2,000 drones, concurrency 50, < 1 min
    .venv/bin/python bench/issuance.py --rate 200    # 200 requests started per second
    .venv/bin/python bench/issuance.py --quick       # 300 drones
    .venv/bin/python bench/issuance.py --drones 5000 --concurrency 100 --sites 10

One embedded nats-server in operator mode (a new authority, the buckets as
``broker init`` makes them) and, in this process, the real
:class:`~broker.manager.service.ManagerService` with its issuer and an echo responder.
The ``--drones`` drones (spread over ``--sites`` sites, each with a user key of its own)
run in a second process, ``--concurrency`` requests at a time (or started at ``--rate``
per second, at most ``--concurrency`` at a time). Phases, in order:

1. **mint**: the issuer's :meth:`~broker.manager.issuer.Issuer.mint` for every drone
   (what the site adapter does at deploy: a token hash in the grant bucket);
2. **echo baselines** (same server, same concurrency, as many requests): a core NATS
   request to the responder, which answers at once with the request's bytes, over one
   kept connection, and over a new connection per request (the server checks JWT
   credentials at each connect: what an agent's request costs before the issuer does
   anything);
3. **enroll**: every drone's :class:`~remote_agent.agent.identity.BootstrapIdentity`
   asks for its JWT as the agent does (a new connection on the site's bootstrap
   identity, the signed request with the token, the reply, close);
4. **renew**: the same identities renew (the agent's path again);
5. **renew, kept connection**: renewals over one kept connection per site, so that
   the issuer's own latency is seen without the connect.

A drone's time is taken around its whole request. A sample of drones connects with its
issued JWT and its own key to check the identities are real. It prints counts, rates,
p50/p99/max, the ratios to the baselines and the CPU seconds of the drones' process, of
the manager's and of the server in each phase, and writes JSON to
``bench/results/issuance-<time>.json``. Nothing is asserted. The issuer's rate limit is
per site (``rate_per_s`` 500, ``burst`` 1,000 by default): with more than ``burst``
drones per site and an issuer faster than ``rate_per_s`` a run sees ``throttled``
refusals (counted; the drone asks again after 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import _common
from _issuance_drones import ECHO, NS, drones_process, timed
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker.manager.issuer import IssuerSettings
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.auth.authority import issuer_key_of, save_issuer_key
from broker.server.auth.credentials import bootstrap_credentials
from remote_agent.protocol.connect import close, connect

GOAL_RATE = 200.0
GOAL_P99_MS = 50.0


async def echo_responder(url: str, creds: Path) -> Client:
    responder = await connect(url, user_credentials=str(creds))

    async def answer(msg: Msg) -> None:
        await responder.publish(msg.reply, msg.data)

    await responder.subscribe(ECHO, cb=answer)
    await responder.flush()
    return responder


async def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.basicConfig(level=logging.ERROR)  # refusals are counted, not printed
    async with _common.secured_bus(NS, prefix="cobald-remote-issuance-") as bus:
        sites = [f"site{i + 1}" for i in range(args.sites)]
        for site in sites:
            (bus.tmp / f"{site}.creds").write_text(bootstrap_credentials(bus.authority, NS, site))
        names = [(sites[i % len(sites)], i) for i in range(args.drones)]
        drones = [(site, _common.drone_name(site, i)) for site, i in names]
        key_file = bus.tmp / "issuer.key"  # the account signing key alone, as auth issuer-key
        save_issuer_key(issuer_key_of(bus.authority), key_file)
        settings = ManagerSettings(
            servers=[bus.url],
            creds=str(bus.manager_creds),
            retry_s=0.5,
            issuer=IssuerSettings(key=key_file),
        )
        service = ManagerService(settings)
        service_task = asyncio.create_task(service.run())
        stop = asyncio.Event()
        assert bus.server.pid is not None
        cpu = _common.CpuSampler(bus.server.pid)
        sampler = asyncio.create_task(cpu.run(stop))
        responder = await echo_responder(bus.url, bus.manager_creds)
        try:
            await asyncio.wait_for(service.ready.wait(), 60)
            issuer = service.issuer
            assert issuer is not None
            tokens: dict[str, str] = {}

            async def mint(drone: tuple[str, str]) -> bool:
                tokens[drone[1]] = await issuer.mint(*drone)
                return True

            begun = time.monotonic()
            rows = {"mint": await timed(drones, args.concurrency, mint)}
            rows["mint"]["interval"] = (begun, time.monotonic())
            spec = {
                "url": bus.url,
                "concurrency": args.concurrency,
                "rate_per_s": args.rate,
                "echo_creds": str(bus.manager_creds),
                "drones": [
                    {
                        "site": site,
                        "name": name,
                        "token": tokens[name],
                        "creds": str(bus.tmp / f"{site}.creds"),
                    }
                    for site, name in drones
                ],
            }
            spec_file, out_file = bus.tmp / "spec.json", bus.tmp / "drones.json"
            spec_file.write_text(json.dumps(spec))
            process = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--drones-process", str(spec_file), str(out_file)
            )
            if await process.wait() != 0:
                raise RuntimeError(f"the drones' process failed ({process.returncode})")
            drones_report = json.loads(out_file.read_text())
        finally:
            stop.set()
            await sampler
            await close(responder)
            service.stop()
            await asyncio.wait_for(service_task, 30)
        rows |= drones_report.pop("rows")
        for row in rows.values():
            row["manager_cpu_s"], row["server_cpu_s"] = cpu.between(*row["interval"])
        del rows["mint"]["client_cpu_s"]  # the manager minted: that CPU is the manager's
        return {
            "drones": args.drones,
            "sites": args.sites,
            "concurrency": args.concurrency,
            "rate_per_s": args.rate,
            "rows": rows,
            "issuer_counts": dict(service.issuer_counts),
            **drones_report,
        }


def render(report: dict[str, Any]) -> str:
    rows: dict[str, dict[str, Any]] = report["rows"]
    new = rows["echo, new connection"]
    kept = rows["echo, kept connection"]
    baseline = {
        "enroll": new,
        "renew": new,
        "renew, kept connection": kept,
        "echo, new connection": kept,
    }
    table = []
    for name, row in rows.items():
        base = baseline.get(name)
        table.append(
            [
                name,
                row["count"],
                row["failed"],
                row["per_s"],
                row["p50_ms"],
                row["p99_ms"],
                row["max_ms"],
                f"{row['per_s'] / base['per_s']:.2f}" if base else "-",
                f"{row['p99_ms'] / base['p99_ms']:.2f}" if base else "-",
                row.get("client_cpu_s", "-"),
                row["manager_cpu_s"],
                row["manager_cpu_s"] / row["count"] * 1e3 if row["count"] else "-",
                row["server_cpu_s"],
            ]
        )
    header = (
        "phase",
        "ok",
        "failed",
        "per s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "rate / base",
        "p99 / base",
        "drones CPU s",
        "manager CPU s",
        "manager CPU ms each",
        "server CPU s",
    )
    enroll = rows["enroll"]
    met = enroll["per_s"] >= GOAL_RATE and enroll["p99_ms"] < GOAL_P99_MS
    lines = [
        f"{report['drones']:,} drones on {report['sites']} sites, concurrency "
        f"{report['concurrency']}"
        + (f", {report['rate_per_s']:,.0f} requests started per s" if report["rate_per_s"] else ""),
        _common.table(header, table),
        "baseline of enroll and renew: echo, new connection; of renew, kept connection and "
        "of echo, new connection: echo, kept connection",
        f"issuer counts: {report['issuer_counts']}",
        f"identities checked by connecting: {report['identities_connected']} of "
        f"{report['identities_checked']}",
        f"goal (enroll >= {GOAL_RATE:.0f}/s, p99 < {GOAL_P99_MS:.0f} ms): "
        + ("met" if met else "NOT met"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--drones-process"]:
        report = asyncio.run(drones_process(json.loads(Path(argv[1]).read_text())))
        Path(argv[2]).write_text(json.dumps(report))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drones", type=int, default=2000, help="drones (default 2,000)")
    parser.add_argument("--concurrency", type=int, default=50, help="requests at once (50)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="requests started per second (0: closed loop)"
    )
    parser.add_argument("--sites", type=int, default=4, help="sites the drones are on (4)")
    parser.add_argument("--quick", action="store_true", help="300 drones")
    parser.add_argument("--out", type=Path, help="directory for the JSON (bench/results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.drones = 300
    paced_s = 6 * args.drones / args.rate if args.rate else 0.0  # five phases at --rate
    report = _common.run_bounded(run(args), 60 + args.drones * 0.1 + paced_s)
    print(render(report))
    print(f"written to {_common.write_result('issuance', report, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
