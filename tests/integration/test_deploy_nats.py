"""deploy/nats: every server configuration is valid and runs as documented"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from support.agent import drone_life
from support.agent import settings as agent_settings
from support.manager import running_manager
from support.processes import CLI, free_ports, run_process
from support.servers import ROUTE_USER, cluster_config, hub_and_leaf, uncomment
from support.waiting import wait_until, wait_until_async

from broker.errors import ProvisioningError
from broker.manager.service import ManagerSettings
from broker.server.embedded import EmbeddedServer, find_binary
from broker.server.provision import Topology, provision
from remote_agent.agent import Agent
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol.names import Namespace

DEPLOY = DEPLOY_DIR / "nats"
CONFIGS = sorted(DEPLOY.glob("*.conf"))
NODE_ENV = {
    "NATS_NODE": "n1",
    "NATS_STORE": "/tmp/unused",
    "NATS_CLUSTER_LISTEN": "127.0.0.1:6222",
    "NATS_LEAF_LISTEN": "127.0.0.1:7422",
    "NATS_HUB": "nats-leaf://127.0.0.1:7422",
}


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(find_binary()), "-t", "-c", str(config)],
        env=NODE_ENV,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"single.conf", "cluster.conf", "leaf.conf"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(config: Path, tmp_path: Path) -> None:
    if config.name == "cluster.conf":  # valid with the file the operator adds beside it
        config = cluster_config(tmp_path, [6222], "secret")
    result = validate(config)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "is valid" in result.stderr + result.stdout


def test_cluster_config_fails_closed_without_route_credentials() -> None:
    result = validate(DEPLOY / "cluster.conf")
    assert result.returncode != 0
    assert "cluster-routes.conf" in result.stderr + result.stdout


async def test_single_server_config_runs_and_provisions(tmp_path: Path) -> None:
    # network and store are overridden on the command line; the rest is the file's
    (leaf_port,) = free_ports(1)
    server = EmbeddedServer(
        tmp_path,
        config_file=DEPLOY / "single.conf",
        env={"NATS_STORE": str(tmp_path / "js"), "NATS_LEAF_LISTEN": f"127.0.0.1:{leaf_port}"},
    )
    async with server:
        nc = await nats.connect(server.url)
        try:
            assert set((await provision(nc.jetstream())).values()) == {"created"}
        finally:
            await nc.close()
    assert (tmp_path / "js" / "jetstream").is_dir()  # the file's store_dir was used


def monitor(server: EmbeddedServer, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.monitoring_url}{path}", timeout=5) as answer:
        found: dict[str, Any] = json.load(answer)
    return found


def routed_to(server: EmbeddedServer) -> set[str]:
    """The names of the servers ``server`` has routes to"""
    return {route["remote_name"] for route in monitor(server, "/routez")["routes"] or []}


def refused_routes(server: EmbeddedServer) -> int:
    """How often ``server`` refused a route's credentials, by its log"""
    text = server.log_path.read_text(errors="replace")
    return text.count("Router connection closed: Authentication Failure")


@pytest.mark.timeout(120)
async def test_cluster_routes_need_the_route_credentials(
    cluster: dict[str, EmbeddedServer], tmp_path: Path
) -> None:
    names = set(cluster)
    for name, node in cluster.items():
        await wait_until(
            lambda node=node, name=name: routed_to(node) == names - {name},
            what=f"{name} routed to the other nodes",
        )
    # a host that reaches the route ports: to n1 with no credentials, to n2 with wrong ones
    n1, n2 = (monitor(cluster[name], "/varz")["cluster"]["cluster_port"] for name in ("n1", "n2"))
    intruder = EmbeddedServer(
        tmp_path / "intruder",
        jetstream=False,
        extra_args=[
            "--name",
            "intruder",
            "--cluster_name",
            "cobald-remote",
            "--cluster_listen",
            "nats://127.0.0.1:-1",
            "--routes",
            f"nats-route://127.0.0.1:{n1},nats-route://{ROUTE_USER}:wrong@127.0.0.1:{n2}",
        ],
    )
    async with intruder:
        for name in ("n1", "n2"):
            await wait_until(
                lambda name=name: refused_routes(cluster[name]) >= 2,
                what=f"{name} refusing the intruder's route (more than once)",
            )
        assert routed_to(intruder) == set()
        for name, node in cluster.items():
            assert routed_to(node) == names - {name}
        # what is published on n1 reaches n3's subscriber, and nobody on the intruder
        spy, member, publisher = [
            await nats.connect(url) for url in (intruder.url, cluster["n3"].url, cluster["n1"].url)
        ]
        try:
            seen, delivered = await spy.subscribe(">"), await member.subscribe("cobald.>")
            await spy.flush()
            await member.flush()

            async def reaches_n3() -> bool:
                # n1 learns n3's interest over the route a moment after n3 has it: until
                # then what is published on n1 goes nowhere, so publish until it arrives
                await publisher.publish("cobald.site1.d1.evt.heartbeat", b"secret")
                await publisher.flush()
                try:
                    return (await delivered.next_msg(timeout=0.5)).data == b"secret"
                except nats.errors.TimeoutError:
                    return False

            await wait_until_async(reaches_n3, what="n1's message at n3's subscriber")
            with pytest.raises(nats.errors.TimeoutError):
                await seen.next_msg(timeout=0.5)
        finally:
            for nc in (spy, member, publisher):
                await nc.close()


@pytest.mark.timeout(120)
async def test_cluster_config_survives_losing_the_stream_leader(
    cluster: dict[str, EmbeddedServer],
) -> None:
    urls = [node.url for node in cluster.values()]
    nc = await nats.connect(urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream(timeout=2)
    ns = Namespace()
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
        ("cobald-remote-nats-leaf.service", "leaf.conf"),
    ],
)
def test_systemd_units_match_the_configs(unit: str, config: str) -> None:
    lines = (SYSTEMD / unit).read_text().splitlines()
    service = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    start = service["ExecStart"].split()
    assert start[0].endswith("/nats-server") and start[1] == "-c"
    assert Path(start[2]).name == config and (DEPLOY / config).is_file()
    # every $VARIABLE the config needs is set by the unit
    needed = set(re.findall(r"\$(NATS_[A-Z_]+)", (DEPLOY / config).read_text()))
    given = {line.split("=", 2)[1] for line in lines if line.startswith("Environment=")}
    assert needed and needed <= given
    assert service["KillSignal"] == "SIGUSR2"  # lame duck: clients move before the stop


@pytest.mark.timeout(120)
async def test_leaf_config_carries_a_drone_to_the_central_stream_and_bucket(
    tmp_path: Path,
) -> None:
    """
    A drone behind a site's leaf node (leaf.conf) with the manager at the hub (single.conf)

    The agent connects to the leaf only, naming the hub's JetStream domain:
    its events reach the central stream, its claim and its final record
    reach the central bucket through the leaf connection, and the manager's
    drain command reaches it the other way.
    """
    hub, leaf = hub_and_leaf(tmp_path, DEPLOY / "single.conf", DEPLOY / "leaf.conf")
    async with hub, leaf:
        nc = await nats.connect(hub.url)
        try:
            await provision(nc.jetstream())
        finally:
            await nc.close()
        settings = ManagerSettings(servers=[hub.url], domain="hub", retry_s=0.2, lost_check_s=0.5)
        async with running_manager(settings) as service:
            drone = "site1-00000000aa"
            agent = Agent(agent_settings(tmp_path, leaf.url, drone, domain="hub"))
            # claim, events, the drain command and the final record cross the leaf
            await drone_life(service, agent, reason="leaf test")


def _single_conf(directory: Path) -> Path:
    """The shipped single.conf, copied as it is into ``directory`` (auth.conf goes beside it)"""
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(DEPLOY / "single.conf", directory))


@pytest.mark.timeout(120)
async def test_authentication_takes_a_restart_and_broker_init_says_when_it_is_not_on(
    tmp_path: Path,
) -> None:
    # docs/deployment.md, "Per-drone credentials": auth init, auth manager, uncomment the
    # include, restart; a reload (SIGHUP) cannot switch the server to operator mode
    config = _single_conf(tmp_path / "etc")
    (leaf_port,) = free_ports(1)
    env = {"NATS_STORE": str(tmp_path / "js"), "NATS_LEAF_LISTEN": f"127.0.0.1:{leaf_port}"}
    server = EmbeddedServer(tmp_path / "nats", config_file=config, env=env)
    authority, creds = tmp_path / "authority.json", tmp_path / "manager.creds"
    auth = ("--authority", str(authority))
    async with server:
        code, _, err = await run_process(*CLI, "broker", "init", "--server", server.url)
        assert (code, err) == (0, "")  # open on loopback, as the file says: no warning
        for argv in (
            ("auth", "init", *auth, "--server-config", str(config.parent / "auth.conf")),
            ("auth", "manager", *auth, "--out", str(creds)),
        ):
            code, _, err = await run_process(*CLI, *argv)
            assert code == 0, err
        config.write_text(uncomment(config.read_text(), 'include "auth.conf"'))
        assert server.pid is not None
        os.kill(server.pid, signal.SIGHUP)
        await wait_until(
            lambda: "not supported" in server.log_path.read_text(), what="the refused reload"
        )
        init = (*CLI, "broker", "init", "--server", server.url, "--creds", str(creds))
        code, out, err = await run_process(*init)
        assert code == 0
        assert "accepts clients without credentials" in err
        assert "Restart the server" in err
        assert "another account" not in err  # the same streams: the server has one account

        await server.restart()
        code, out, err = await run_process(*init)
        assert (code, err) == (0, "")
        assert out.splitlines()[0] == "COBALD_EVENTS: created"  # the account's own
        code, _, err = await run_process(*CLI, "broker", "init", "--server", server.url)
        assert code == 1
        assert "refused the credentials" in err


async def test_broker_init_warns_of_this_projects_streams_in_another_account(
    tmp_path: Path,
) -> None:
    config = tmp_path / "accounts.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "accounts {\n"
        "  SITE: { jetstream: enabled, users: [ { user: manager, password: s3cret } ] }\n"
        "  OPEN: { jetstream: enabled, users: [ { user: anyone, password: anyone } ] }\n"
        "}\n"
        "no_auth_user: anyone\n"
    )
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:
        code, _, err = await run_process(*CLI, "broker", "init", "--server", server.url)
        assert (code, err) == (0, "")  # into OPEN, the account of clients without credentials
        manager = server.url.replace("nats://", "nats://manager:s3cret@")
        code, out, err = await run_process(*CLI, "broker", "init", "--server", manager)
        assert code == 0
        assert out.splitlines()[0] == "COBALD_EVENTS: created"
        assert "accepts clients without credentials" in err
        assert "holds this project's streams (COBALD_EVENTS, ...) in another account" in err


#: a configuration's usage line in its header: ``#   VAR=value ... nats-server -c NAME``
_USAGE = re.compile(r"^#\s+((?:[A-Z_]+=\S+\s+)+)nats-server -c (\S+)\s*$", re.M)


def usage_line(config: Path) -> tuple[dict[str, str], str]:
    """The environment and the file of the usage line in ``config``'s header"""
    found = _USAGE.search(config.read_text())
    assert found is not None, f"{config.name} has no usage line"
    return dict(part.split("=", 1) for part in found.group(1).split()), found.group(2)


def on_this_host(value: str, directory: Path) -> str:
    """
    A usage line's value with its places moved onto this test: a directory into
    ``directory``, a host and port to a free port on loopback (the file's other ports are
    moved on the command line)
    """
    if value.startswith("/"):
        return str(directory / value.strip("/").replace("/", "-"))
    (port,) = free_ports(1)
    return re.sub(r"[\w.-]+:\d+$", f"127.0.0.1:{port}", value)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
async def test_every_configuration_starts_as_its_header_says(config: Path, tmp_path: Path) -> None:
    usage, name = usage_line(config)
    assert name == config.name
    copy = tmp_path / "etc" / name
    if name == "cluster.conf":  # the header names the routes file beside it
        copy = cluster_config(copy.parent, free_ports(1), "s3cret-route-password")
    else:
        copy.parent.mkdir()
        shutil.copy(config, copy)
    env = {key: on_this_host(value, tmp_path) for key, value in usage.items()}
    client, monitoring = free_ports(2)
    log = tmp_path / "nats-server.log"
    command = [str(find_binary()), "-c", name, "-a", "127.0.0.1", "-p", str(client)]
    command += ["-m", str(monitoring), "-l", str(log)]
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=copy.parent, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        await wait_until(
            lambda: (
                proc.returncode is not None
                or (log.exists() and "Server is ready" in log.read_text())
            ),
            what=f"{name} started",
        )
        assert proc.returncode is None, (await proc.communicate())[1].decode()
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.communicate()
