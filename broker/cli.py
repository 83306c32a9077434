"""
The ``cobald-remote`` command line

The command groups live in :mod:`broker.commands` (the drone's ``agent`` group
in :mod:`remote_agent.cli`); this module only wires them together and
configures logging. A command's arguments are added when it runs, and its
handler imports the code it drives, so each command loads only its own part.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from broker.commands import auth, demo, ops, protocol, timeline
from broker.commands import broker as broker_commands
from broker.commands.failures import run
from broker.commands.lazy import Commands
from remote_agent.cli import add_commands as add_agent_commands


def _parser() -> tuple[argparse.ArgumentParser, Commands]:
    parser = argparse.ArgumentParser(
        prog="cobald-remote",
        description="Message-bus coordination between TARDIS/COBalD and their drones",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    groups = parser.add_subparsers(action=Commands, dest="group", required=True, metavar="COMMAND")
    assert isinstance(groups, Commands)
    broker_commands.add_commands(groups)
    protocol.add_commands(groups)
    add_agent_commands(groups)
    ops.add_commands(groups)  # drain, release, status
    timeline.add_commands(groups)
    auth.add_commands(groups)  # auth init, drone, manager, leaf, revoke
    demo.add_commands(groups)
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
