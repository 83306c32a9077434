"""The options several commands share: where the bus is, its subject prefix, JSON output"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from remote_agent.protocol.names import DEFAULT_PREFIX

if TYPE_CHECKING:
    from nats.aio.client import Client

#: ``--server`` of the commands that take several URLs
SERVERS_HELP = "NATS URL(s), comma-separated"


def add_prefix(parser: argparse.ArgumentParser) -> None:
    """``--prefix``: the first subject token"""
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="first subject token")


def add_connection(
    parser: argparse.ArgumentParser,
    *,
    server_help: str = SERVERS_HELP,
    creds_help: str = "NATS credentials file",
) -> None:
    """``--server``, ``--creds``, ``--domain`` and ``--prefix``"""
    parser.add_argument("--server", required=True, help=server_help)
    parser.add_argument("--creds", help=creds_help)
    parser.add_argument("--domain", help="JetStream domain (leaf-node deployments)")
    add_prefix(parser)


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: print JSON instead of text"""
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


async def connect(args: argparse.Namespace, name: str) -> Client:
    """Connect to ``--server`` with ``--creds`` as client ``name``, failing fast"""
    from broker.server.connection import connect_once

    return await connect_once(args.server, args.creds, name=name)


def add_seconds(
    parser: argparse.ArgumentParser, flag: str, default: float, help: str, metavar: str = "SECONDS"
) -> None:
    """Add an option that takes a number of seconds"""
    parser.add_argument(flag, type=float, default=default, metavar=metavar, help=help)
