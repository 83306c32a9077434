"""
The ``cobald-remote`` command line

The command groups live in :mod:`broker.commands` (the drone's ``agent`` group
in :mod:`remote_agent.cli`); this module only wires them together, configures
logging and maps failures to exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from broker.commands import auth, demo, ops, protocol, timeline
from broker.commands import broker as broker_commands
from broker.commands.failures import CliError
from broker.errors import BrokerError
from remote_agent.cli import add_commands as add_agent_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cobald-remote",
        description="Message-bus coordination between TARDIS/COBalD and their drones",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    groups = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    broker_commands.add_commands(groups)
    protocol.add_commands(groups)
    add_agent_commands(groups)
    ops.add_commands(groups)  # drain, release, status
    timeline.add_commands(groups)
    auth.add_commands(groups)  # auth init, drone, manager, leaf, revoke
    demo.add_commands(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG
        if args.verbose > 1
        else logging.INFO
        if args.verbose
        else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        result = args.run(args)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    except (CliError, BrokerError) as err:
        print(f"cobald-remote: {err}", file=sys.stderr)
        return 1
    return int(result)


if __name__ == "__main__":
    sys.exit(main())
