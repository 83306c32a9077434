"""
``cobald-remote deploy``: list, print or copy the shipped deployment files

Works in the drone-side install: it reads only :mod:`remote_agent.deploy_files`,
imported when a ``deploy`` command runs (not on every start of the command line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from broker.commands.options import add_json
from broker.commands.table import write_json
from broker.errors import CliError


def _list(args: argparse.Namespace) -> int:
    from remote_agent import deploy_files

    chosen = deploy_files.select(args.name) if args.name else deploy_files.shipped()
    if args.json:
        write_json({"root": str(deploy_files.DEPLOY_DIR), "files": list(chosen)})
    else:
        sys.stdout.write("".join(f"{name}\n" for name in chosen))
    return 0


def _show(args: argparse.Namespace) -> int:
    from remote_agent import deploy_files

    chosen = deploy_files.select(args.name)
    if len(chosen) != 1:
        names = ", ".join(chosen)
        raise deploy_files.DeployFileError(f"{args.name!r} is a group; name one file: {names}")
    sys.stdout.buffer.write(next(iter(chosen.values())).read_bytes())
    return 0


def _copy(args: argparse.Namespace) -> int:
    from remote_agent import deploy_files

    written = deploy_files.copy(args.name, args.directory, force=args.force)
    if args.json:
        write_json({"written": [str(path) for path in written]})
    else:
        sys.stdout.write("".join(f"{path}\n" for path in written))
    return 0


def _run(args: argparse.Namespace) -> int:
    from remote_agent.deploy_files import DeployFileError

    try:
        return int(args.deploy_run(args))
    except DeployFileError as err:
        raise CliError(str(err)) from err


def add_commands(deploy: argparse.ArgumentParser) -> None:
    """Add the ``deploy`` group's commands"""
    cmds = deploy.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = cmds.add_parser("list", help="the shipped files, as GROUP/FILE")
    listing.add_argument("name", nargs="?", metavar="NAME", help="only this group or file")
    add_json(listing)
    listing.set_defaults(run=_run, deploy_run=_list)
    show = cmds.add_parser("show", help="print one file (GROUP/FILE) on stdout")
    show.add_argument("name", metavar="GROUP/FILE")
    show.set_defaults(run=_run, deploy_run=_show)
    copy = cmds.add_parser(
        "copy", help="copy a group (e.g. htcondor) or one file into DIR; scripts executable"
    )
    copy.add_argument("name", metavar="NAME", help="a group or GROUP/FILE")
    copy.add_argument("directory", metavar="DIR", type=Path, help="created if missing")
    copy.add_argument("--force", action="store_true", help="replace files that differ")
    add_json(copy)
    copy.set_defaults(run=_run, deploy_run=_copy)
