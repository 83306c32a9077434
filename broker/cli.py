"""
The ``cobald-remote`` command line

Every command and its line of help are in :data:`COMMANDS`; the commands
themselves live in :mod:`broker.commands` (the drone's ``agent`` group in
:mod:`remote_agent.cli`). A command's arguments are added only when it runs,
and its handler imports the code it drives, so each command loads its own part.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Final

from broker.commands import auth, broker, config, demo, deploy, ops, protocol, timeline
from broker.commands.failures import run
from broker.commands.lazy import Commands, Fill
from remote_agent import cli as agent

#: the commands in the order ``--help`` lists them: name, what adds its arguments, help
COMMANDS: Final[tuple[tuple[str, Fill, str], ...]] = (
    ("broker", broker.add_commands, "the NATS broker: embedded server, provisioning"),
    ("protocol", protocol.add_commands, "wire-format tools"),
    ("agent", agent.add_commands, "the drone agent: run it around the drone's worker"),
    ("drain", ops.add_drain, "drain a drone: record the intent, tell its agent; payloads finish"),
    (
        "release",
        ops.add_release,
        "release a drone that has not come up; drain it if its agent already has",
    ),
    (
        "status",
        ops.add_status,
        "table of drones: state, payloads, age of the last fact, lost, record phase",
    ),
    (
        "timeline",
        timeline.add_arguments,
        "one drone's life: its agent's events beside TARDIS's state",
    ),
    ("auth", auth.add_commands, "per-drone NATS credentials (operator mode)"),
    (
        "check-config",
        config.add_arguments,
        "what cobald-remote will do with a COBalD configuration",
    ),
    ("deploy", deploy.add_commands, "the shipped deployment files: list, show, copy"),
    (
        "demo",
        demo.add_arguments,
        "the demonstration: real COBalD and TARDIS, emulated site and drones, on this machine",
    ),
)


def _parser() -> tuple[argparse.ArgumentParser, Commands]:
    parser = argparse.ArgumentParser(
        prog="cobald-remote",
        description="Message-bus coordination between TARDIS/COBalD and their drones",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    groups = parser.add_subparsers(action=Commands, dest="group", required=True, metavar="COMMAND")
    assert isinstance(groups, Commands)
    for name, fill, help_text in COMMANDS:
        groups.add_command(name, fill, help=help_text)
    return parser, groups


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, every command's arguments included"""
    parser, groups = _parser()
    groups.fill()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser()[0].parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG
        if args.verbose > 1
        else logging.INFO
        if args.verbose
        else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
