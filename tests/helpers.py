"""Small helpers for the tests (importable: tests/ is on sys.path)"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from broker.server import EmbeddedServer


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
