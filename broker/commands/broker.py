"""``cobald-remote broker serve|init``: the embedded server and provisioning"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

from broker.commands.options import add_connection, add_json, add_prefix, connected
from remote_agent.protocol.names import Namespace

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from broker.server.provision import Topology

log = logging.getLogger("cobald.runtime.cobald_remote.cli")

#: the name of the commands' client connections
_CLIENT = "cobald-remote-cli"


#: ``broker serve``'s store below the user's data directory
_STORE: Final = Path("cobald-remote", "nats")
#: the user's data directory unless ``$XDG_DATA_HOME`` names one, below the home directory
_DATA_HOME: Final = Path(".local", "share")


def default_store_dir() -> Path:
    """Where ``broker serve`` keeps JetStream data unless told otherwise"""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / _DATA_HOME
    return Path(data_home) / _STORE


#: :func:`default_store_dir` as the help says it: named, not resolved for this machine
STORE_HELP: Final = f"$XDG_DATA_HOME/{_STORE}, else ~/{_DATA_HOME / _STORE}"


def _topology(args: argparse.Namespace) -> Topology:
    from broker.server.provision import Topology

    return Topology(namespace=Namespace(args.prefix), replicas=args.replicas)


async def _init(args: argparse.Namespace) -> int:
    from broker.server.provision import provision

    topology = _topology(args)
    async with connected(args, _CLIENT) as nc:
        js = nc.jetstream(domain=args.domain)
        actions = await provision(js, topology)
        warnings = await _anonymous_access(args, js, topology) if _identified(args) else []
    for line in warnings:
        print(f"cobald-remote: warning: {line}", file=sys.stderr)
    if args.json:
        from broker.commands.table import write_json

        write_json(actions)
    else:
        for name, action in actions.items():
            print(f"{name}: {action}")
    return 0


def _identified(args: argparse.Namespace) -> bool:
    """Whether the command connects with credentials: a ``.creds`` file or a user in a URL"""
    return bool(args.creds) or any("@" in url for url in args.server.split(","))


def _anonymous(servers: str) -> str:
    """``servers`` (comma-separated URLs) without the users and passwords in them"""
    from urllib.parse import urlsplit

    urls = (urlsplit(url.strip()) for url in servers.split(","))
    return ",".join(url._replace(netloc=url.netloc.rpartition("@")[2]).geturl() for url in urls)


async def _stream_created(js: JetStreamContext, name: str) -> object:
    """
    When the account of ``js`` created stream ``name``; ``None`` if it has none of that name
    (or no JetStream, or does not answer)
    """
    import nats.errors

    try:
        return (await js.stream_info(name)).created
    except (nats.errors.Error, TimeoutError):  # APIError included
        return None


async def _anonymous_access(
    args: argparse.Namespace, js: JetStreamContext, topology: Topology
) -> list[str]:
    """
    What ``broker init``, connected with credentials, warns of: the server also lets clients
    in without any, and keeps this project's streams in their account too

    A server still running the configuration it had before ``include "auth.conf"`` (a
    reload cannot turn on operator mode; only a restart does) takes the manager's
    credentials and every anonymous client alike, all in its global account.
    """
    from broker.errors import ConnectError
    from broker.server.connection import connect_once
    from remote_agent.protocol.connect import close

    try:
        anonymous = await connect_once(_anonymous(args.server), name=_CLIENT)
    except ConnectError:
        return []  # credentials are needed: as it should be
    warnings = [
        "the server accepts clients without credentials, each with every permission: "
        "authentication is not in force. Restart the server after enabling "
        "'include \"auth.conf\"' (a reload cannot turn it on), then run broker init again "
        '(docs: deployment, "Per-drone credentials")'
    ]
    try:
        theirs = anonymous.jetstream(domain=args.domain)
        events = topology.namespace.event_stream
        mine, other = await _stream_created(js, events), await _stream_created(theirs, events)
        if other is not None and other != mine:
            warnings.append(
                f"the server also holds this project's streams ({events}, ...) in another "
                "account, the one of clients without credentials: drones that connect "
                "without credentials publish there, not to the manager"
            )
    finally:
        await close(anonymous)
    return warnings


async def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from broker.server.connection import connect_once
    from broker.server.embedded import EmbeddedServer
    from broker.server.provision import provision
    from remote_agent.protocol.connect import close

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = EmbeddedServer(
        args.store or default_store_dir(),
        host=args.host,
        port=args.port,
        sync_always=args.sync_always,
        binary=args.nats_server,
    )
    async with server:
        nc = await connect_once(server.url, name=_CLIENT)
        try:
            actions = await provision(nc.jetstream(), _topology(args))
        finally:
            await close(nc)
        log.info("provisioned %s", ", ".join(f"{k} {v}" for k, v in actions.items()))
        if args.json:  # one line: the command runs on, a script reads what it has
            import json

            facts = {"url": server.url, "pid": server.pid, "store": str(server.store_dir)}
            print(json.dumps(facts), flush=True)
        else:
            print(server.url, flush=True)
        print(
            f"nats-server pid {server.pid} serving {server.url}, store {server.store_dir}; "
            "Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    return 0


def _add_replicas(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="stream replicas (3 on a cluster)")


def add_commands(broker: argparse.ArgumentParser) -> None:
    """Add the ``broker`` group's commands"""
    broker_cmds = broker.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = broker_cmds.add_parser(
        "serve", help="run the embedded nats-server with JetStream, provisioned, until interrupted"
    )
    serve.add_argument("--store", type=Path, help=f"JetStream store (default {STORE_HELP})")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=-1, help="client port (default: a free one)")
    serve.add_argument("--sync-always", action="store_true", help="fsync every write")
    serve.add_argument("--nats-server", help="nats-server executable (default: from the wheel)")
    add_prefix(serve)
    _add_replicas(serve)
    serve.add_argument(
        "--json", action="store_true", help="print the URL, pid and store as one JSON line"
    )
    serve.set_defaults(run=_serve)
    init = broker_cmds.add_parser(
        "init", help="create or update every stream and bucket; safe to repeat"
    )
    add_connection(init, server_help="NATS URL, e.g. nats://127.0.0.1:4222")
    _add_replicas(init)
    add_json(init)
    init.set_defaults(run=_init)
