"""Small helpers for the tests (importable: tests/ is on sys.path)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import nats

from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.auth.authority import create_authority, load_authority, save_authority
from broker.server.auth.credentials import drone_credentials, manager_credentials
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.protocol.names import Namespace


def pid_exists(pid: int) -> bool:
    """Whether a process with ``pid`` is still around (tests check we stopped ours)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_ports(count: int) -> list[int]:
    """Loopback ports for listeners whose port must be known before a server starts"""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def hub_and_leaf(
    tmp_path: Path, hub_config: Path, leaf_config: Path
) -> tuple[EmbeddedServer, EmbeddedServer]:
    """
    A central server and a site's leaf node connected to it (not started yet)

    With the environment ``deploy/systemd`` gives them: the hub's JetStream
    store and leaf listener, the leaf's node name and its hub URL.
    """
    (leaf_port,) = free_ports(1)
    hub = EmbeddedServer(
        tmp_path / "hub",
        config_file=hub_config,
        env={"NATS_STORE": str(tmp_path / "js"), "NATS_LEAF_LISTEN": f"127.0.0.1:{leaf_port}"},
    )
    leaf = EmbeddedServer(
        tmp_path / "leaf",
        config_file=leaf_config,
        env={"NATS_NODE": "site1-leaf", "NATS_HUB": f"nats-leaf://127.0.0.1:{leaf_port}"},
    )
    return hub, leaf


@contextlib.asynccontextmanager
async def secured_server(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedServer, Path]]:
    """
    A nats-server in operator mode with JetStream, provisioned by the manager

    Yields the server and the authority file; ``tmp_path / "manager.creds"``
    holds the manager's credentials, :func:`drone_creds` mints a drone's.
    """
    authority_file = tmp_path / "authority.json"
    save_authority(create_authority(), authority_file)
    authority = load_authority(authority_file)
    config = tmp_path / "server.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n' + authority.server_config()
    )
    server = EmbeddedServer(tmp_path / "nats", config_file=config)
    async with server:
        manager = tmp_path / "manager.creds"
        manager.write_text(manager_credentials(authority))
        nc = await nats.connect(server.url, user_credentials=str(manager))
        try:
            await provision(nc.jetstream())
        finally:
            await nc.close()
        yield server, authority_file


def drone_creds(tmp_path: Path, authority_file: Path, site: str, drone: str) -> Path:
    """A ``.creds`` file with one drone's permissions, next to the authority"""
    path = tmp_path / f"{drone}.creds"
    path.write_text(drone_credentials(load_authority(authority_file), Namespace(), site, drone))
    return path


@contextlib.asynccontextmanager
async def running_manager(
    settings: ManagerSettings, registry: Registry | None = None
) -> AsyncIterator[ManagerService]:
    """A :class:`ManagerService` run as COBalD would, ready (rebuilt); stopped at the end"""
    service = ManagerService(settings, registry)
    task = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 30)
        yield service
    finally:
        service.stop()
        await asyncio.wait_for(task, 30)
