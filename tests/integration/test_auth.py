"""Per-drone credentials (broker/server/auth/) against a real nats-server in operator mode"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
from pathlib import Path

import nats
import nats.errors
import pytest
from support.agent import SITE, drone_life
from support.agent import settings as agent_settings
from support.manager import running_manager
from support.processes import CLI, run_process
from support.servers import drone_creds, hub_and_leaf, refused_for_another, uncomment

from broker.cli import main
from broker.errors import AuthError
from broker.manager.service import ManagerSettings
from broker.server.auth.authority import (
    create_authority,
    load_authority,
    save_authority,
)
from broker.server.auth.credentials import drone_credentials
from broker.server.auth.jwt import creds_claims
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.names import Namespace

pytestmark = pytest.mark.timeout(120)
NS = Namespace()
DRONE = "site1-00000000aa"
OTHER = "site1-00000000bb"


async def test_a_drone_runs_on_its_own_credentials_and_cannot_speak_for_another(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority_file = secured
    settings = ManagerSettings(
        servers=[server.url], creds=str(tmp_path / "manager.creds"), retry_s=0.2
    )
    async with running_manager(settings) as service:
        agent = Agent(
            agent_settings(
                tmp_path,
                server.url,
                DRONE,
                creds=drone_creds(tmp_path, authority_file, SITE, DRONE),
            )
        )
        # its own claim, events, record and answers are allowed; with the same
        # credentials, nothing of another drone is
        await drone_life(
            service,
            agent,
            while_up=lambda: refused_for_another(
                server.url, tmp_path / f"{DRONE}.creds", DRONE, OTHER
            ),
            reason="auth test",
        )
        assert service.registry.view(SITE, OTHER) is None


async def test_credentials_of_another_authority_are_refused(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, _ = secured
    stranger = tmp_path / "stranger.creds"
    stranger.write_text(drone_credentials(create_authority(), NS, SITE, DRONE))
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
        await asyncio.wait_for(
            connect(server.url, user_credentials=str(stranger), allow_reconnect=False), 30
        )


def test_drone_credentials_carry_its_permissions_and_expire() -> None:
    authority = create_authority()
    text = drone_credentials(authority, NS, SITE, DRONE, valid_for_s=3600, domain="hub")
    claims = creds_claims(text)
    assert claims["name"] == f"drone-{DRONE}"
    assert claims["exp"] - claims["iat"] == 3600
    nats_claims = claims["nats"]
    assert nats_claims["issuer_account"] == authority.account_public
    assert set(nats_claims["pub"]["allow"]) == {
        *(f"cobald.{SITE}.{DRONE}.evt.{ev.kind_of(kind)}" for kind in ev.EVENT_TYPES),
        f"$JS.hub.API.$KV.cobald-drones.{SITE}.{DRONE}",
        f"$JS.hub.API.DIRECT.GET.KV_cobald-drones.$KV.cobald-drones.{SITE}.{DRONE}",
    }
    assert f"_INBOX_{DRONE}.>" in nats_claims["sub"]["allow"]
    assert "-----BEGIN USER NKEY SEED-----\nSU" in text
    with pytest.raises(SchemaError):
        drone_credentials(authority, NS, SITE, "no.dots")


def test_the_authority_file_is_private_and_made_once(tmp_path: Path) -> None:
    path = tmp_path / "authority.json"
    save_authority(create_authority(), path)
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(AuthError, match="exists"):
        save_authority(create_authority(), path)
    (tmp_path / "bad.json").write_text('{"operator": "x"}')
    with pytest.raises(AuthError, match="not a cobald-remote authority file"):
        load_authority(tmp_path / "bad.json")


async def test_the_commands_make_a_working_setup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """auth init / drone / manager, as an operator runs them, against a real server"""
    authority, server_config = tmp_path / "authority.json", tmp_path / "auth.conf"
    given = ["--authority", str(authority)]
    assert main(["auth", "init", *given, "--server-config", str(server_config)]) == 0
    assert server_config.stat().st_mode & 0o777 == 0o600
    drone_creds, manager_creds = tmp_path / "drone.creds", tmp_path / "manager.creds"
    assert main(["auth", "drone", DRONE, *given, "--out", str(drone_creds)]) == 0
    assert main(["auth", "manager", *given]) == 0
    manager_creds.write_text(capsys.readouterr().out)
    assert main(["auth", "drone", "nodash", *given]) == 1
    assert "give --site" in capsys.readouterr().err
    config = tmp_path / "server.conf"
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth.conf"\n')
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:
        manager = await nats.connect(server.url, user_credentials=str(manager_creds))
        drone = await nats.connect(
            server.url, user_credentials=str(drone_creds), inbox_prefix=f"_INBOX_{DRONE}"
        )
        try:
            await provision(manager.jetstream())
            ack = await drone.jetstream().publish(NS.event(SITE, DRONE, "heartbeat"), b"x")
            assert ack.stream == NS.event_stream
        finally:
            await drone.close()
            await manager.close()


def test_drone_credentials_expire_after_a_week_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/deployment.md: 7 days by default; ``--valid-for 0``: never"""
    default = creds_claims(drone_credentials(create_authority(), NS, SITE, DRONE))
    assert default["exp"] == default["iat"] + 7 * 24 * 3600  # type: ignore[operator]
    authority = tmp_path / "authority.json"
    save_authority(create_authority(), authority)
    assert main(["auth", "drone", DRONE, "--authority", str(authority), "--valid-for", "0"]) == 0
    assert "exp" not in creds_claims(capsys.readouterr().out)


DEPLOY_NATS = DEPLOY_DIR / "nats"


@pytest.mark.timeout(180)
async def test_a_leaf_node_checks_the_credentials_of_its_drones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """
    leaf.conf with per-drone credentials, set up with the commands an operator runs

    The hub runs single.conf, the leaf leaf.conf, both with the same auth.conf.
    A drone on the leaf runs its whole life on its own credentials (claim,
    events, drain command, final record cross the leaf); with them it can do
    nothing for another drone, which the leaf refuses before anything reaches
    the hub.
    """
    authority = tmp_path / "authority.json"
    given = ["--authority", str(authority)]
    hub_dir, leaf_dir = tmp_path / "hub-conf", tmp_path / "leaf-conf"
    hub_dir.mkdir()
    leaf_dir.mkdir()
    assert main(["auth", "init", *given, "--server-config", str(hub_dir / "auth.conf")]) == 0
    shutil.copy(hub_dir / "auth.conf", leaf_dir / "auth.conf")
    leaf_creds, manager_creds = tmp_path / "site1-leaf.creds", tmp_path / "manager.creds"
    capsys.readouterr()
    assert main(["auth", "leaf", SITE, *given, "--out", str(leaf_creds)]) == 0
    account = re.search(r"account: (A[A-Z0-9]{55})", capsys.readouterr().err)
    assert account is not None and account[1] == load_authority(authority).account_public
    assert main(["auth", "manager", *given, "--out", str(manager_creds)]) == 0
    drone_creds = tmp_path / "drone.creds"
    assert main(["auth", "drone", DRONE, *given, "--domain", "hub", "--out", str(drone_creds)]) == 0

    shutil.copy(DEPLOY_NATS / "single.conf", hub_dir)
    (hub_dir / "hub.conf").write_text('include "single.conf"\ninclude "auth.conf"\n')
    leaf_conf = uncomment(
        (DEPLOY_NATS / "leaf.conf").read_text(), "credentials:", "account:", 'include "auth.conf"'
    )
    leaf_conf = leaf_conf.replace("/etc/cobald-remote/nats/site1-leaf.creds", str(leaf_creds))
    (leaf_dir / "leaf.conf").write_text(leaf_conf.replace("ACCOUNT_PUBLIC_KEY", account[1]))
    hub, leaf = hub_and_leaf(tmp_path, hub_dir / "hub.conf", leaf_dir / "leaf.conf")
    async with hub, leaf:
        nc = await connect(hub.url, user_credentials=str(manager_creds))
        try:
            await provision(nc.jetstream())
        finally:
            await nc.close()
        settings = ManagerSettings(
            servers=[hub.url], creds=str(manager_creds), domain="hub", retry_s=0.2
        )
        async with running_manager(settings) as service:
            agent = Agent(
                agent_settings(tmp_path, leaf.url, DRONE, creds=drone_creds, domain="hub")
            )
            # the claim, the events, the drain command and the final record all
            # cross the leaf; the leaf refuses what the drone may not do
            await drone_life(
                service,
                agent,
                while_up=lambda: refused_for_another(
                    leaf.url, drone_creds, DRONE, OTHER, domain="hub"
                ),
                reason="leaf auth test",
            )
            assert service.registry.view(SITE, OTHER) is None
            assert service.registry.metrics().rejected_total == 0


async def test_a_new_sites_first_steps_make_their_directories(tmp_path: Path) -> None:
    # docs/deployment.md, "A new site, step by step": steps 1, 2 and 4 as written, with
    # /etc/cobald-remote moved below tmp_path (a directory that does not exist yet)
    doc = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    steps = doc[doc.index("### A new site, step by step") :]
    commands = re.findall(r"`(cobald-remote auth (?:init|manager|issuer-key) [^`]+)`", steps)
    assert [command.split()[2] for command in commands] == ["init", "manager", "issuer-key"]
    etc = tmp_path / "etc" / "cobald-remote"
    for command in commands:
        argv = shlex.split(command.replace("/etc/cobald-remote", str(etc)))
        code, _, err = await run_process(*CLI, *argv[1:])
        assert code == 0, err
    for name in ("authority.json", "nats/auth.conf", "manager.creds", "issuer-key.json"):
        assert (etc / name).stat().st_mode & 0o777 == 0o600, name
