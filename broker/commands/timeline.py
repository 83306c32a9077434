"""``cobald-remote timeline DRONE``: one drone's life as a table"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from broker.commands.options import add_connection, add_json, connected
from broker.commands.table import format_table, write_json
from remote_agent.protocol.names import Namespace, check_token

if TYPE_CHECKING:
    from broker.manager.timeline import Row


def _time(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def format_timeline(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table (UTC times)"""
    header = ("TIME (UTC)", "DRONE EVENT", "DRONE STATE", "TARDIS STATE")
    return format_table(
        header, ((_time(r.at), r.drone_event or "", r.drone_state, r.tardis_state) for r in rows)
    )


async def timeline(args: argparse.Namespace) -> int:
    """``cobald-remote timeline DRONE``"""
    from broker.errors import TimelineError
    from broker.manager.timeline import read_timeline

    drone = check_token(args.drone, "drone uuid")
    site = check_token(args.site, "site") if args.site else None
    namespace = Namespace(args.prefix)
    async with connected(args, "cobald-remote-timeline") as nc:
        rows = await read_timeline(
            nc, namespace, drone, site, domain=args.domain, heartbeats=args.heartbeats
        )
    if not rows:
        raise TimelineError(f"nothing about drone {drone!r} in {namespace.event_stream}")
    if args.json:
        write_json([asdict(row) for row in rows])
    else:
        print(format_timeline(rows))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``timeline``'s arguments"""
    parser.description = (
        "Read one drone's events and TARDIS's state notes from the event stream "
        "(read-only) and print them in time order; an ended drone's last row is its "
        "end and why, as the manager decides it from its handshake record."
    )
    parser.add_argument("drone", help="drone uuid, e.g. site1-0123456789")
    parser.add_argument("--site", help="the drone's site (default: any)")
    add_connection(parser)
    parser.add_argument("--heartbeats", action="store_true", help="include heartbeats")
    add_json(parser)
    parser.set_defaults(run=timeline)
