"""``cobald-remote demo``: the demonstration (the emulation is imported only when it runs)"""

from __future__ import annotations

import argparse

from broker.commands.options import add_seconds
from broker.errors import CliError


def _demo(args: argparse.Namespace) -> int:
    # the demo drives the real COBalD and TARDIS: without the manager install, one line that
    # names it (broker.commands.failures) before anything starts
    import broker.tardis.factory  # noqa: F401

    # the emulation is not product code: imported only when the demo runs
    from broker.emulation.demo.command import main as demo_main

    try:
        return demo_main(args)
    except RuntimeError as err:
        raise CliError(str(err)) from None


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """Add ``demo``'s arguments"""
    demo.description = (
        "Run a seeded scenario of strongly swinging demand with the real COBalD "
        "daemon and TARDIS on the embedded broker: drones are local processes running the "
        "real agent around an emulated startd. Prints progress, then a table of drones, "
        "payloads (started, finished, killed), release outcomes and the status latency "
        "TARDIS saw (docs/tardis.md)."
    )
    demo.add_argument("--seed", type=int, default=1, help="seed of the scenario (default 1)")
    demo.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the same scenario with stock TARDIS, then print both columns "
        "(default; --no-compare: the run with cobald-remote alone)",
    )
    demo.add_argument("--json", metavar="FILE", help="also write the table(s) as JSON")
    add_seconds(
        demo,
        "--duration",
        80.0,
        "seconds of swinging demand per run (default 80; 30 s of zero demand follow)",
        metavar="S",
    )
    demo.add_argument(
        "--drones", type=int, default=5, metavar="N", help="most drones at once (default 5)"
    )
    demo.add_argument(
        "--demand",
        choices=("controller", "scripted"),
        help="who sets COBalD's demand: COBalD's LinearController from the pool's utilisation "
        "and allocation, as at a site, with payloads arriving in seeded swings (default), or "
        "the scenario's script, with an endless supply of payloads: the swings under which "
        "TARDIS kills payloads (docs/tardis.md)",
    )
    demo.add_argument(
        "--scale-down-window",
        type=float,
        metavar="S",
        help="cobald-remote's bus.scale_down_window_s in the demo's time (default 10: the "
        "300 s default at TARDIS's 60 s heartbeat, scaled to the demo's 2 s; 0: off)",
    )
    demo.add_argument(
        "--utilisation-hold",
        type=float,
        metavar="S",
        help="cobald-remote's bus.utilisation_hold_s in the demo's time (default 2: the "
        "60 s default, scaled alike; 0: off)",
    )
    demo.add_argument(
        "--workdir", metavar="DIR", help="keep every file of the runs here (default: a temp dir)"
    )
    demo.add_argument(
        "--tardis-adapters",
        choices=("emulated", "htcondor", "slurm"),
        default="emulated",
        help="TARDIS's site and batch-system adapters: the demo's polled ones (default), "
        "TARDIS's own HTCondor adapters against fake condor_* tools, or TARDIS's Slurm "
        "adapter against a real single-node Slurm it starts (root, slurm-wlm; docs/tardis.md)",
    )
    demo.add_argument(
        "--walltime",
        type=float,
        metavar="S",
        help="with --tardis-adapters slurm: each drone job's walltime in seconds, a whole "
        "number of minutes (TARDIS's Walltime, sbatch --time); each payload then asks for "
        "the longest payload duration, and the table adds the payloads killed at the "
        "drone's end and vacated (default: an hour, longer than the run)",
    )
    demo.add_argument(
        "--preempt",
        type=int,
        default=0,
        metavar="N",
        help="with --tardis-adapters slurm: the site preempts N running drone jobs during "
        "the run, as Slurm's PreemptMode=CANCEL does (SIGTERM, SIGKILL after KillWait); "
        "each payload then asks for the longest payload duration (default 0)",
    )
    demo.add_argument(
        "--bootstrap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the broker in operator mode, each drone on an identity of its own that it "
        "bootstraps from a one-time token (docs/deployment.md#bootstrap); default: on",
    )
    demo.set_defaults(run=_demo)
