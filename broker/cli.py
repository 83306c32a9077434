"""
The ``cobald-remote`` command line

Every command and its line of help are in :data:`COMMANDS`; the commands
themselves live in :mod:`broker.commands` (the drone's ``agent`` group in
:mod:`remote_agent.cli`). A command's arguments are added only when it runs,
and its handler imports the code it drives, so each command loads its own part.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any, Final

from broker.commands import (
    auth,
    broker,
    config,
    demo,
    deploy,
    ops,
    protocol,
    selftest,
    timeline,
)
from broker.commands.failures import run
from broker.commands.options import add_before, before_the_command, refused_before, takes_before
from broker.commands.subcommands import Commands, Fill
from remote_agent import __version__
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
        "table of drones: state, payloads, age of the last fact, noisy, lost, record phase",
    ),
    (
        "timeline",
        timeline.add_arguments,
        "one drone's life: its agent's events beside TARDIS's state",
    ),
    ("auth", auth.add_commands, "per-drone NATS credentials (operator mode)"),
    (
        "selftest",
        selftest.add_arguments,
        "prove a site end to end: one stand-in drone's whole life against the server and manager",
    ),
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

#: ``-v`` is counted per level of the command line (argparse gives each subcommand a
#: namespace of its own), in ``verbose``, ``verbose_1``, ...
_VERBOSE: Final = "verbose"
#: the namespace attribute naming the chosen command (``deploy list``), for its errors
_COMMAND: Final = "command_name"


def _add_globals(parser: argparse.ArgumentParser, level: int = 0) -> None:
    """The options every command takes, before or after its name"""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        dest=f"{_VERBOSE}_{level}" if level else _VERBOSE,
        # below the top: unset unless given, so that no level resets another
        default=argparse.SUPPRESS if level else 0,
        help="more log output (-vv: debug)",
    )


def _verbosity(args: argparse.Namespace) -> int:
    """How often ``-v`` was given, on any level"""
    levels = (name for name in vars(args) if name.split("_")[0] == _VERBOSE)
    return sum(getattr(args, name) for name in levels)


def _with_globals(fill: Fill) -> Fill:
    """``fill``, then ``-v`` on the command and each subcommand, the bus options on groups"""

    def filled(parser: argparse.ArgumentParser) -> None:
        fill(parser)
        for sub, level in _tree(parser, 1):
            _add_globals(sub, level)
            sub.set_defaults(**{_COMMAND: sub.prog.partition(" ")[2]})
            if _subcommands(sub):  # what its commands take
                add_before(sub, {f for leaf, _ in _tree(sub, level) for f in takes_before(leaf)})

    return filled


def _tree(
    command: argparse.ArgumentParser, level: int
) -> list[tuple[argparse.ArgumentParser, int]]:
    """``command``'s parser and every subcommand's parser below it, with their levels"""
    found = [(command, level)]
    for action in _subcommands(command):
        for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
            found += _tree(sub, level + 1)
    return found


def _subcommands(command: argparse.ArgumentParser) -> list[argparse._SubParsersAction[Any]]:
    return [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]


class _Commands(Commands):
    """The commands of every level: the bus options before their names are theirs"""

    def parsing(
        self, command: argparse.ArgumentParser, namespace: argparse.Namespace
    ) -> contextlib.AbstractContextManager[None]:
        return before_the_command(namespace, [sub for sub, _ in _tree(command, 1)])


class _Parser(argparse.ArgumentParser):
    """
    A parser whose subcommands' parsers (its class too) add :class:`_Commands`, and
    which refuses a bus option given before the name of a command that does not take it
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        if refused := refused_before(parsed):
            command = getattr(parsed, _COMMAND, "this command")
            self.error(f"{command} takes no {' or '.join(refused)} before its name")
        return parsed, rest


def _parser() -> tuple[argparse.ArgumentParser, Commands]:
    parser = _Parser(
        prog="cobald-remote",
        description="Message-bus coordination between TARDIS/COBalD and their drones",
    )
    _add_globals(parser)
    add_before(parser)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    groups = parser.add_subparsers(action=_Commands, dest="group", required=True, metavar="COMMAND")
    assert isinstance(groups, Commands)
    for name, fill, help_text in COMMANDS:
        groups.add_command(name, _with_globals(fill), help=help_text)
    return parser, groups


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, every command's arguments included"""
    parser, groups = _parser()
    groups.fill()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser()[0].parse_args(argv)
    verbose = _verbosity(args)
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
