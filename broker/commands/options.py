"""
The options several commands share: where the bus is, its subject prefix, JSON output

Its rule: ``--server``, ``--creds``, ``--prefix`` and ``--domain`` default to the
project's own variables, as the agent reads them (``COBALD_REMOTE_URL``, ...), and
``--server`` and ``--creds`` then to the ``nats`` command line's (``NATS_URL``, ``NATS_CREDS``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from remote_agent.protocol.environment import BUS_SETTINGS_ENV
from remote_agent.protocol.names import DEFAULT_PREFIX

if TYPE_CHECKING:
    from nats.aio.client import Client

#: ``--server`` of the commands that take several URLs
SERVERS_HELP = "NATS URL(s), comma-separated"
#: the variables ``--server`` defaults to, the first set one wins
SERVER_ENV: Final = (BUS_SETTINGS_ENV["servers"], "NATS_URL")
#: the variables ``--creds`` defaults to, the first set one wins
CREDS_ENV: Final = (BUS_SETTINGS_ENV["creds"], "NATS_CREDS")
#: the variable ``--prefix`` defaults to
PREFIX_ENV: Final = (BUS_SETTINGS_ENV["prefix"],)
#: the variable ``--domain`` defaults to
DOMAIN_ENV: Final = (BUS_SETTINGS_ENV["domain"],)
#: every variable the options default to
ALL_ENV: Final = (*SERVER_ENV, *CREDS_ENV, *PREFIX_ENV, *DOMAIN_ENV)

#: what to do when the server refuses the commands' subjects
_NEEDS_MANAGER: Final = (
    "these commands need the manager's credentials (--creds; cobald-remote auth manager)"
)


def from_env(names: Sequence[str], env: Mapping[str, str] = os.environ) -> str | None:
    """The value of the first of ``names`` set (and not empty) in ``env``"""
    return next((env[name].strip() for name in names if env.get(name, "").strip()), None)


def _env_help(help_text: str, names: Sequence[str], otherwise: str = "") -> str:
    fallback = f", else {otherwise}" if otherwise else ""
    return f"{help_text} (default: ${', else $'.join(names)}{fallback})"


def add_prefix(parser: argparse.ArgumentParser) -> None:
    """``--prefix``: the first subject token"""
    parser.add_argument(
        "--prefix",
        default=from_env(PREFIX_ENV) or DEFAULT_PREFIX,
        help=_env_help("first subject token", PREFIX_ENV, DEFAULT_PREFIX),
    )


def add_connection(
    parser: argparse.ArgumentParser,
    *,
    server_help: str = SERVERS_HELP,
    creds_help: str = "NATS credentials file",
) -> None:
    """``--server``, ``--creds`` (both defaulting to the environment), ``--domain``, ``--prefix``"""
    server = from_env(SERVER_ENV)
    parser.add_argument(
        "--server", default=server, required=server is None, help=_env_help(server_help, SERVER_ENV)
    )
    parser.add_argument(
        "--creds", default=from_env(CREDS_ENV), help=_env_help(creds_help, CREDS_ENV)
    )
    parser.add_argument(
        "--domain",
        default=from_env(DOMAIN_ENV),
        help=_env_help("JetStream domain, for leaf-node deployments", DOMAIN_ENV, "none"),
    )
    add_prefix(parser)


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: print JSON instead of text"""
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


async def connect(args: argparse.Namespace, name: str) -> Client:
    """Connect to ``--server`` with ``--creds`` as client ``name``, failing fast"""
    from broker.server.connection import connect_once

    return await connect_once(args.server, args.creds, name=name)


def refused(nc: Client) -> str:
    """The line for a server that refused one of the connection's subjects; ``""`` if it did not"""
    last = nc.last_error
    if last is not None and "permissions violation" in str(last).lower():
        return f"{last}: {_NEEDS_MANAGER}"
    return ""


@contextlib.asynccontextmanager
async def connected(args: argparse.Namespace, name: str) -> AsyncIterator[Client]:
    """
    :func:`connect`, closed on the way out; a failure after the server refused a subject
    is reported as that refusal

    :raises OperatorError: if the server refused one of the connection's subjects
    """
    nc = await connect(args, name)
    try:
        yield nc
    except Exception:
        if line := refused(nc):
            from broker.errors import OperatorError

            raise OperatorError(line) from None
        raise
    finally:
        await nc.close()


def add_seconds(
    parser: argparse.ArgumentParser, flag: str, default: float, help: str, metavar: str = "SECONDS"
) -> None:
    """Add an option that takes a number of seconds"""
    parser.add_argument(flag, type=float, default=default, metavar=metavar, help=help)
