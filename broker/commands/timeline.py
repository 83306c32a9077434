"""``cobald-remote timeline DRONE``: one drone's life as a table"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from remote_agent.protocol.events import Namespace, SchemaError, check_token

if TYPE_CHECKING:
    from broker.manager.timeline import Row


def _time(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table (UTC times)"""
    header = ("TIME (UTC)", "DRONE EVENT", "DRONE STATE", "TARDIS STATE")
    cells = [(_time(r.at), r.drone_event or "", r.drone_state, r.tardis_state) for r in rows]
    table = [header, *cells]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    )


async def timeline(args: argparse.Namespace) -> int:
    """``cobald-remote timeline DRONE``"""
    from broker.manager.timeline import TimelineError, read_timeline
    from broker.server.connection import connect_once

    try:
        drone = check_token(args.drone, "drone uuid")
        site = check_token(args.site, "site") if args.site else None
        namespace = Namespace(args.prefix)
    except SchemaError as err:
        raise TimelineError(str(err)) from None
    nc = await connect_once(args.server, args.creds, name="cobald-remote-timeline")
    try:
        rows = await read_timeline(
            nc, namespace, drone, site, domain=args.domain, heartbeats=args.heartbeats
        )
    finally:
        await nc.close()
    if not rows:
        raise TimelineError(f"nothing about drone {drone!r} in {namespace.event_stream}")
    if args.json:
        sys.stdout.write(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    else:
        print(format_table(rows))
    return 0


def add_commands(groups: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``timeline`` to the ``cobald-remote`` command line"""
    parser = groups.add_parser(
        "timeline",
        help="one drone's life: its agent's events beside TARDIS's state",
        description="Read one drone's events and TARDIS's state notes from the event stream "
        "(read-only) and print them in time order.",
    )
    parser.add_argument("drone", help="drone uuid, e.g. site1-0123456789")
    parser.add_argument("--site", help="the drone's site (default: any)")
    parser.add_argument("--server", required=True, help="NATS URL(s), comma-separated")
    parser.add_argument("--creds", help="NATS credentials file")
    parser.add_argument("--domain", help="JetStream domain (leaf-node deployments)")
    parser.add_argument("--prefix", default=Namespace().prefix, help="first subject token")
    parser.add_argument("--heartbeats", action="store_true", help="include heartbeats")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(run=timeline)
