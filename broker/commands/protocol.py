"""``cobald-remote protocol decode``: wire-format tools"""

from __future__ import annotations

import argparse
import sys

from remote_agent.protocol.events import DEFAULT_MAX_SIZE, SchemaError, decode, to_json


def _decode(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read()
    try:
        message = decode(data, max_size=args.max_size)
    except SchemaError as err:
        print(f"cobald-remote: {err}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(to_json(message) + b"\n")
    return 0


def add_commands(groups: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``protocol`` group (``decode``)"""
    protocol = groups.add_parser("protocol", help="wire-format tools")
    protocol_cmds = protocol.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dec = protocol_cmds.add_parser(
        "decode", help="decode one message from stdin and print it as JSON"
    )
    dec.add_argument("--max-size", type=int, default=DEFAULT_MAX_SIZE, help="limit in bytes")
    dec.set_defaults(run=_decode)
