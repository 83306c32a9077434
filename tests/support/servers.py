"""NATS servers for the tests: secured, hub and leaf, a cluster, drone credentials, a proxy"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors

from broker.errors import ProvisioningError
from broker.server.auth.authority import create_authority, load_authority, save_authority
from broker.server.auth.credentials import drone_credentials, manager_credentials
from broker.server.embedded import EmbeddedServer
from broker.server.provision import Topology, provision
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace, inbox_prefix
from support.processes import free_ports
from support.waiting import wait_until


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


#: the user of the cluster's routes in :func:`cluster_config`
ROUTE_USER = "route"


def cluster_config(directory: Path, route_ports: list[int], password: str) -> Path:
    """
    The shipped cluster.conf, copied as it is, beside the route credentials file

    ``cluster-routes.conf`` as docs/deployment.md ("Route credentials") has the
    operator write it: the route authorization and the routes, whose URLs carry it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = Path(shutil.copy(DEPLOY_DIR / "nats" / "cluster.conf", directory))
    routes = ", ".join(
        f"nats-route://{ROUTE_USER}:{password}@127.0.0.1:{port}" for port in route_ports
    )
    (directory / "cluster-routes.conf").write_text(
        f'authorization {{ user: {ROUTE_USER}, password: "{password}" }}\nroutes: [ {routes} ]\n'
    )
    return config


@contextlib.asynccontextmanager
async def three_nodes(tmp_path: Path) -> AsyncIterator[dict[str, EmbeddedServer]]:
    """A cluster of three nodes (``n1`` to ``n3``) with the shipped cluster.conf, started"""
    # no --cluster_listen: that flag, given without credentials, drops the file's
    # route authorization (nats-server server/opts.go, overrideCluster)
    ports = free_ports(6)
    config = cluster_config(tmp_path / "etc", ports[:3], "s3cret-route-password")
    nodes = {
        f"n{i}": EmbeddedServer(
            tmp_path / f"n{i}",
            config_file=config,
            env={
                "NATS_NODE": f"n{i}",
                "NATS_STORE": str(tmp_path / f"n{i}"),
                "NATS_CLUSTER_LISTEN": f"127.0.0.1:{port}",
                "NATS_LEAF_LISTEN": f"127.0.0.1:{leaf_port}",
            },
        )
        for i, (port, leaf_port) in enumerate(zip(ports[:3], ports[3:], strict=True), start=1)
    }
    try:
        await asyncio.gather(*(node.start() for node in nodes.values()))
        yield nodes
    finally:
        await asyncio.gather(*(node.stop() for node in nodes.values()))


async def provision_cluster(urls: list[str]) -> None:
    """Provision a fresh cluster with three replicas, once its JetStream has a leader"""
    nc = await connect(urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream(timeout=2)
        for _ in range(300):  # the meta leader needs a moment after start
            try:
                await provision(js, Topology(replicas=3))
                return
            except (ProvisioningError, nats.errors.Error):  # "not ready yet"
                await asyncio.sleep(0.2)
        raise AssertionError("the cluster never became ready for provisioning")
    finally:
        await close(nc)


def uncomment(config: str, *keys: str) -> str:
    """leaf.conf's commented lines for ``keys``, switched on as docs/deployment.md says"""
    for key in keys:
        config, found = re.subn(rf"^(\s*)# ({re.escape(key)})", r"\1\2", config, flags=re.M)
        assert found == 1, f"leaf.conf has no commented {key!r} line"
    return config


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


async def refused_for_another(
    url: str, creds: Path, drone: str, other: str, domain: str | None = None, site: str = "site1"
) -> None:
    """With ``drone``'s credentials: ``other``'s event, record and commands are all refused"""
    errors: list[str] = []
    ns = Namespace()

    async def note(err: Exception) -> None:
        errors.append(str(err))

    spoof = await connect(
        url, user_credentials=str(creds), inbox_prefix=inbox_prefix(drone), error_cb=note
    )
    api = f"$JS.{domain}.API.$KV" if domain else "$KV"
    try:
        await spoof.publish(ns.event(site, other, "drained"), b"x")
        await spoof.publish(f"{api}.{ns.record_bucket}.{site}.{other}", b"x")
        await spoof.subscribe(ns.command(site, other))
        await spoof.flush()
        await wait_until(lambda: len(errors) >= 3, 10, "three permission violations")
    finally:
        await close(spoof)
    assert all("permissions violation" in error for error in errors), errors


def drone_creds(tmp_path: Path, authority_file: Path, site: str, drone: str) -> Path:
    """A ``.creds`` file with one drone's permissions, next to the authority"""
    path = tmp_path / f"{drone}.creds"
    path.write_text(drone_credentials(load_authority(authority_file), Namespace(), site, drone))
    return path


class TcpProxy:
    """A loopback TCP forwarder the test can cut, to disconnect one client from a live server"""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        writers = [writer]
        self._writers.add(writer)  # from the start: a cut while we connect upstream ends it too
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:  # the server is down: the client sees the connection end
                return
            writers.append(up_writer)
            if self._server is None or writer.is_closing():  # cut while we connected
                return
            self._writers.add(up_writer)
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self._writers.difference_update(writers)
            for each in writers:
                each.close()
                with contextlib.suppress(OSError):
                    await each.wait_closed()
            self._handlers.discard(task)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def cut(self) -> None:
        """Drop every connection and stop listening: new connections are refused"""
        # refused, not accepted and closed: a client that gets no INFO leaks its socket
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def restore(self) -> None:
        """Listen again on the same port"""
        await self.start()

    async def close(self) -> None:
        await self.cut()
