"""deploy/nats: every server configuration is valid and runs as documented"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest

from broker.errors import ProvisioningError
from broker.provision import Topology, provision
from broker.server import EmbeddedServer, find_binary
from remote_agent import events as ev

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
CONFIGS = sorted(DEPLOY.glob("*.conf"))
NODE_ENV = {"NATS_NODE": "n1", "NATS_STORE": "/tmp/unused"}


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"single.conf", "cluster.conf"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(config: Path) -> None:
    result = subprocess.run(
        [str(find_binary()), "-t", "-c", str(config)],
        env=NODE_ENV,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "is valid" in result.stderr + result.stdout


async def test_single_server_config_runs_and_provisions(tmp_path: Path) -> None:
    # network and store are overridden on the command line; the rest is the file's
    server = EmbeddedServer(
        tmp_path, config_file=DEPLOY / "single.conf", env={"NATS_STORE": str(tmp_path / "js")}
    )
    async with server:
        nc = await nats.connect(server.url)
        try:
            assert set((await provision(nc.jetstream())).values()) == {"created"}
        finally:
            await nc.close()
    assert (tmp_path / "js" / "jetstream").is_dir()  # the file's store_dir was used


def _free_ports(count: int) -> list[int]:
    """Loopback ports for cluster routes, which must be known before the nodes start"""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, EmbeddedServer]]:
    ports = _free_ports(3)
    routes = ",".join(f"nats://127.0.0.1:{port}" for port in ports)
    nodes = {
        f"n{i}": EmbeddedServer(
            tmp_path / f"n{i}",
            config_file=DEPLOY / "cluster.conf",
            env={"NATS_NODE": f"n{i}", "NATS_STORE": str(tmp_path / f"n{i}")},
            extra_args=["--cluster_listen", f"nats://127.0.0.1:{port}", "--routes", routes],
        )
        for i, port in enumerate(ports, start=1)
    }
    try:
        await asyncio.gather(*(node.start() for node in nodes.values()))
        yield nodes
    finally:
        await asyncio.gather(*(node.stop() for node in nodes.values()))


@pytest.mark.timeout(120)
async def test_cluster_config_survives_losing_the_stream_leader(
    cluster: dict[str, EmbeddedServer],
) -> None:
    urls = [node.url for node in cluster.values()]
    nc = await nats.connect(urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream(timeout=2)
    ns = ev.Namespace()
    for _ in range(100):  # the meta leader needs a moment after start
        try:
            await provision(js, Topology(replicas=3))
            break
        except (ProvisioningError, nats.errors.Error):  # "not ready yet"
            await asyncio.sleep(0.2)
    else:
        pytest.fail("cluster never became ready for provisioning")

    async def publish(i: int) -> None:
        for _ in range(100):  # retry election errors with the same id: no loss, no duplicate
            try:
                await js.publish(
                    ns.event("site1", "d1", "heartbeat"),
                    b"%d" % i,
                    headers={"Nats-Msg-Id": f"d1:x:{i}"},
                )
                return
            except (TimeoutError, nats.errors.Error):
                await asyncio.sleep(0.2)
        raise AssertionError(f"message {i} never stored")

    for i in range(100):
        await publish(i)
    leader = (await js.stream_info(ns.event_stream)).cluster
    assert leader is not None and leader.leader in cluster
    await cluster[leader.leader].kill()
    for i in range(100, 200):
        await publish(i)
    for _ in range(100):
        try:
            info = await js.stream_info(ns.event_stream)
            break
        except nats.errors.Error:
            await asyncio.sleep(0.2)
    assert info.state.messages == 200
    assert info.config.num_replicas == 3
    await nc.close()


SYSTEMD = DEPLOY.parent / "systemd"


@pytest.mark.parametrize(
    ("unit", "config"),
    [
        ("cobald-remote-nats.service", "single.conf"),
        ("cobald-remote-nats@.service", "cluster.conf"),
    ],
)
def test_systemd_units_match_the_configs(unit: str, config: str) -> None:
    lines = (SYSTEMD / unit).read_text().splitlines()
    service = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    start = service["ExecStart"].split()
    assert start[0].endswith("/nats-server") and start[1] == "-c"
    assert Path(start[2]).name == config and (DEPLOY / config).is_file()
    # every $VARIABLE the config needs is set by the unit
    needed = set(re.findall(r"\$(NATS_[A-Z]+)", (DEPLOY / config).read_text()))
    given = {line.split("=", 2)[1] for line in lines if line.startswith("Environment=")}
    assert needed and needed <= given
    assert service["KillSignal"] == "SIGUSR2"  # lame duck: clients move before the stop
