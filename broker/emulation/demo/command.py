"""
``cobald-remote demo``: stock TARDIS against TARDIS with cobald-remote (docs/tardis.md section 7)

Its rule: every process started here is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker.emulation.demo.auth import secure
from broker.emulation.demo.bus import interesting_drone, record_outcomes, sample_timeline
from broker.emulation.demo.report import table
from broker.emulation.demo.run import MODES, Progress, run_mode, to_stderr
from broker.emulation.demo.scenario import Scenario
from broker.server.embedded import EmbeddedServer
from broker.server.provision import Topology, provision
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace

#: the demonstration's one site, as the shipped ``cobald/demo.yaml`` names it (in lower case)
DEMO_SITE = "demo"


async def demo(
    scenario: Scenario,
    modes: Sequence[str],
    root: Path,
    *,
    progress: Progress = to_stderr,
    bootstrap: bool = False,
) -> dict[str, Any]:
    """
    Run ``modes`` in turn on one embedded broker; the results by mode

    :param bootstrap: the broker in operator mode, each drone on an identity of its own
    """
    results: dict[str, Any] = {}
    namespace = Namespace()
    auth = secure(root / "auth", namespace, DEMO_SITE) if bootstrap else None
    server = EmbeddedServer(root / "nats", config_file=auth.server_config if auth else None)
    creds = str(auth.manager_creds) if auth else None
    await server.start()
    try:
        nc = await connect(server.url, connect_timeout=2, user_credentials=creds)
        try:
            await provision(nc.jetstream(), Topology(namespace=namespace))
        finally:
            await close(nc)
        progress(f"embedded broker {server.url} (pid {server.pid})")
        for mode in modes:
            progress(f"--- {MODES[mode]}: seed {scenario.seed}, {scenario.total_s:.0f}s")
            result = await run_mode(
                scenario,
                mode,
                root / mode,
                nats_url=server.url,
                bus_keys=auth.bus_keys if auth else None,
            )
            if mode == "remote":
                result["handshake_records"] = await record_outcomes(server.url, namespace, creds)
                drone = interesting_drone(root / mode)
                if drone is not None:
                    result["sample_drone"] = drone
                    result["sample_timeline"] = await sample_timeline(
                        server.url, namespace, drone, creds
                    )
            results[mode] = result
    finally:
        await server.stop()
    return results


def _scenario(args: argparse.Namespace) -> Scenario:
    """The scenario the options describe; the scenario's defaults where an option is not given"""
    given = {
        "demand": args.demand,
        "scale_down_window_s": args.scale_down_window,
        "utilisation_hold_s": args.utilisation_hold,
        "walltime_s": args.walltime,
    }
    try:
        return Scenario(
            seed=args.seed,
            duration_s=args.duration,
            max_drones=args.drones,
            tardis_adapters=args.tardis_adapters,
            preemptions=args.preempt,
            **{key: value for key, value in given.items() if value is not None},
        )
    except ValueError as err:  # the CLI's one line, not a traceback
        raise RuntimeError(str(err)) from None


def main(args: argparse.Namespace) -> int:
    """``cobald-remote demo`` (``broker/cli.py`` parses the options)"""
    scenario = _scenario(args)
    modes = ["stock", "remote"] if args.compare else ["remote"]
    keep = args.workdir is not None
    root = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="cobald-remote-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    if scenario.demand == "controller":
        arrivals = scenario.arrivals()
        demand = (
            f"COBalD's LinearController (interval {scenario.controller_interval_s:.3f}s, "
            f"rate {scenario.controller_rate:g}/s) sets the demand; {len(arrivals)} payloads "
            f"({sum(d for _, d in arrivals):.0f} core-s) arrive in swings for "
            f"{scenario.duration_s:.0f}s, then none for {scenario.cooldown_s:.0f}s; "
            f"swings {scenario.schedule()}"
        )
    else:
        demand = (
            f"demand swings for {scenario.duration_s:.0f}s then {scenario.cooldown_s:.0f}s "
            f"at zero; schedule {scenario.schedule()}"
        )
    if scenario.walltime_s is not None:
        demand += f"; each drone job's walltime {scenario.walltime_s:.0f}s"
    if scenario.preemptions:
        demand += f"; the site preempts a drone job at {scenario.preemption_times()} s"
    if scenario.payload_ad():
        demand += f"; each payload asks for {scenario.payload_ad()['AllowedJobDuration']}s"
    to_stderr(
        f"cobald-remote demo: seed {scenario.seed}, up to {scenario.max_drones} drones of "
        f"{scenario.slots} slots, {demand}"
    )
    try:
        results = asyncio.run(demo(scenario, modes, root, bootstrap=args.bootstrap))
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
