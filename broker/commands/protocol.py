"""``cobald-remote protocol decode``: wire-format tools"""

from __future__ import annotations

import argparse
import sys

from remote_agent.protocol.bootstrap import decode_any
from remote_agent.protocol.events import to_json
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE


def _decode(args: argparse.Namespace) -> int:
    message = decode_any(sys.stdin.buffer.read(), max_size=args.max_size)
    sys.stdout.buffer.write(to_json(message) + b"\n")
    return 0


def add_commands(protocol: argparse.ArgumentParser) -> None:
    """Add the ``protocol`` group's commands"""
    protocol_cmds = protocol.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dec = protocol_cmds.add_parser(
        "decode", help="decode one message from stdin and print it as JSON"
    )
    dec.add_argument("--max-size", type=int, default=DEFAULT_MAX_SIZE, help="limit in bytes")
    dec.set_defaults(run=_decode)
