"""
The ``cobald-remote`` command line

Subcommand groups: ``broker`` (embedded server, provisioning) and ``protocol``
(wire-format tools). Each group lives with the code it drives; this module
only wires them together and configures logging.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from nats.aio.client import Client

from broker.commands.ops import add_commands as add_operator_commands
from broker.errors import BrokerError
from broker.manager.timeline import add_command as add_timeline_command
from broker.server.auth import add_auth_commands
from broker.server.connection import connect_once
from broker.server.embedded import EmbeddedServer
from broker.server.provision import Topology, provision
from remote_agent.cli import add_commands as add_agent_commands
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import DEFAULT_MAX_SIZE, decode, to_json
from remote_agent.protocol.names import Namespace

log = logging.getLogger(__name__)


def default_store_dir() -> Path:
    """Where ``broker serve`` keeps JetStream data unless told otherwise"""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "cobald-remote" / "nats"


class CliError(Exception):
    """A failure to report in one line and exit 1"""


async def connect(url: str, creds: str | None = None) -> Client:
    """Connect for one command of this module"""
    return await connect_once(url, creds, name="cobald-remote-cli")


def _topology(args: argparse.Namespace) -> Topology:
    return Topology(namespace=Namespace(args.prefix), replicas=args.replicas)


async def _init(args: argparse.Namespace) -> int:
    nc = await connect(args.server, args.creds)
    try:
        actions = await provision(nc.jetstream(domain=args.domain), _topology(args))
    finally:
        await nc.close()
    for name, action in actions.items():
        print(f"{name}: {action}")
    return 0


async def _serve(args: argparse.Namespace) -> int:
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
        nc = await connect(server.url)
        try:
            actions = await provision(nc.jetstream(), _topology(args))
        finally:
            await nc.close()
        log.info("provisioned %s", ", ".join(f"{k} {v}" for k, v in actions.items()))
        print(server.url, flush=True)
        print(
            f"nats-server pid {server.pid} serving {server.url}, store {server.store_dir}; "
            "Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    return 0


def _decode(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read()
    try:
        message = decode(data, max_size=args.max_size)
    except SchemaError as err:
        print(f"cobald-remote: {err}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(to_json(message) + b"\n")
    return 0


def _add_bus_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", default=Namespace().prefix, help="first subject token")
    parser.add_argument("--replicas", type=int, default=1, help="stream replicas (3 on a cluster)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cobald-remote",
        description="Message-bus coordination between TARDIS/COBalD and their drones",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    groups = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")

    broker = groups.add_parser("broker", help="the NATS broker: embedded server, provisioning")
    broker_cmds = broker.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = broker_cmds.add_parser(
        "serve", help="run the embedded nats-server with JetStream, provisioned, until interrupted"
    )
    serve.add_argument(
        "--store", type=Path, help=f"JetStream store (default {default_store_dir()})"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=-1, help="client port (default: a free one)")
    serve.add_argument("--sync-always", action="store_true", help="fsync every write")
    serve.add_argument("--nats-server", help="nats-server executable (default: from the wheel)")
    _add_bus_options(serve)
    serve.set_defaults(run=_serve)
    init = broker_cmds.add_parser(
        "init", help="create or update every stream and bucket; safe to repeat"
    )
    init.add_argument("--server", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222")
    init.add_argument("--creds", help="NATS credentials file")
    init.add_argument("--domain", help="JetStream domain (leaf-node deployments)")
    _add_bus_options(init)
    init.set_defaults(run=_init)

    protocol = groups.add_parser("protocol", help="wire-format tools")
    protocol_cmds = protocol.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dec = protocol_cmds.add_parser(
        "decode", help="decode one message from stdin and print it as JSON"
    )
    dec.add_argument("--max-size", type=int, default=DEFAULT_MAX_SIZE, help="limit in bytes")
    dec.set_defaults(run=_decode)
    add_agent_commands(groups)
    add_operator_commands(groups)  # drain, release, status (broker/commands/ops.py)
    add_timeline_command(groups)  # timeline (broker/manager/timeline.py)
    add_auth_commands(groups)  # auth init, drone, manager (broker/server/auth.py)
    _add_demo_command(groups)

    return parser


def _demo(args: argparse.Namespace) -> int:
    # the emulation is not product code: imported only when the demo runs
    from emulation.demo import main as demo_main

    try:
        return demo_main(args)
    except RuntimeError as err:
        raise CliError(str(err)) from None


def _add_demo_command(groups: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = groups.add_parser(
        "demo",
        help="the demonstration: real COBalD and TARDIS, emulated site and drones, on this machine",
        description="Run a seeded scenario of strongly swinging demand with the real COBalD "
        "daemon and TARDIS on the embedded broker: drones are local processes running the "
        "real agent around an emulated startd. Prints progress, then a table of drones, "
        "payloads (started, finished, killed), release outcomes and the status latency "
        "TARDIS saw (docs/tardis.md).",
    )
    demo.add_argument("--seed", type=int, default=1, help="seed of the scenario (default 1)")
    demo.add_argument(
        "--compare",
        action="store_true",
        help="first run the same scenario with stock TARDIS, then print both columns",
    )
    demo.add_argument("--json", metavar="FILE", help="also write the table(s) as JSON")
    demo.add_argument(
        "--duration",
        type=float,
        default=80.0,
        metavar="S",
        help="seconds of swinging demand per run (default 80; 30 s of zero demand follow)",
    )
    demo.add_argument(
        "--drones", type=int, default=5, metavar="N", help="most drones at once (default 5)"
    )
    demo.add_argument(
        "--workdir", metavar="DIR", help="keep every file of the runs here (default: a temp dir)"
    )
    demo.add_argument(
        "--tardis-adapters",
        choices=("emulated", "htcondor"),
        default="emulated",
        help="TARDIS's site and batch-system adapters: the demo's polled ones (default), or "
        "TARDIS's own HTCondor adapters against fake condor_* tools (docs/tardis.md)",
    )
    demo.set_defaults(run=_demo)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG
        if args.verbose > 1
        else logging.INFO
        if args.verbose
        else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        result = args.run(args)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    except (CliError, BrokerError) as err:
        print(f"cobald-remote: {err}", file=sys.stderr)
        return 1
    return int(result)


if __name__ == "__main__":
    sys.exit(main())
