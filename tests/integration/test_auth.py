"""Per-drone credentials (broker/server/auth/) against a real nats-server in operator mode"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from support.agent import SITE, drone_life
from support.agent import settings as agent_settings
from support.manager import running_manager
from support.servers import drone_creds, hub_and_leaf, refused_for_another, uncomment

from broker.cli import main
from broker.errors import AuthError
from broker.manager.service import ManagerSettings
from broker.server.auth.authority import (
    create_authority,
    load_authority,
    load_issuer_key,
    save_authority,
)
from broker.server.auth.credentials import drone_credentials, leaf_credentials
from broker.server.auth.jwt import creds_claims, decode_jwt
from broker.server.auth.revocation import (
    expired_users,
    issued_log,
    issued_users,
    note_issued,
    revoke,
)
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import close, connect
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


def test_the_server_configuration_is_the_same_each_time_it_is_made() -> None:
    """A running nats-server reloads only a configuration with the same operator JWT"""
    authority = create_authority()
    assert authority.server_config() == authority.server_config()
    user = "U" + "A" * 55
    revoked = revoke(authority, [user], at=authority.issued_at + 60)
    config = revoked.server_config()
    operator_line = next(line for line in config.splitlines() if line.startswith("operator:"))
    assert operator_line in authority.server_config()  # only the account JWT changed
    account_jwt = config.split(f"  {authority.account_public}: ")[1].split("\n")[0]
    claims = decode_jwt(account_jwt)
    assert claims["nats"]["revocations"] == {user: authority.issued_at + 60}
    assert claims["iat"] == authority.issued_at + 60
    with pytest.raises(AuthError, match="not a user public key"):
        revoke(authority, ["ADRONE"])
    # a revocation is dropped once the revoked credentials expired (the server refuses them)
    later = "U" + "B" * 55
    pruned = revoke(revoked, [later], at=authority.issued_at + 90, expired={user})
    assert pruned.revocations == {later: authority.issued_at + 90}


def test_revoke_finds_what_was_issued_and_what_expired(tmp_path: Path) -> None:
    authority_file = tmp_path / "authority.json"
    save_authority(create_authority(), authority_file)
    authority = load_authority(authority_file)
    for valid_for_s in (3600.0, 1.0):
        note_issued(
            authority_file,
            drone_credentials(authority, NS, SITE, DRONE, valid_for_s=valid_for_s),
        )
    note_issued(authority_file, leaf_credentials(authority, SITE))
    users = issued_users(authority_file, DRONE)
    assert len(users) == 2 and users == issued_users(authority_file, f"drone-{DRONE}")
    assert len(issued_users(authority_file, "leaf-site1")) == 1
    assert issued_users(authority_file, OTHER) == []
    assert expired_users(authority_file, now=time.time() + 60) == {users[1]}
    assert issued_log(authority_file).stat().st_mode & 0o777 == 0o600


def test_revoke_takes_a_user_name_or_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/deployment.md: ``revoke manager``, ``revoke --user U...``; unknown names refused"""
    authority_file, server_config = tmp_path / "authority.json", tmp_path / "auth.conf"
    given = ["--authority", str(authority_file)]
    assert main(["auth", "init", *given]) == 0
    assert main(["auth", "manager", *given, "--out", str(tmp_path / "manager.creds")]) == 0
    manager = creds_claims((tmp_path / "manager.creds").read_text())["sub"]
    key = "U" + "C" * 55
    capsys.readouterr()
    assert (
        main(
            [
                "auth",
                "revoke",
                "manager",
                "--user",
                key,
                *given,
                "--server-config",
                str(server_config),
            ]
        )
        == 0
    )
    assert set(load_authority(authority_file).revocations) == {manager, key}
    assert server_config.read_text() == load_authority(authority_file).server_config()
    assert main(["auth", "revoke", "site1-unknown", *given]) == 1
    assert "no credentials issued as 'site1-unknown'" in capsys.readouterr().err


@pytest.mark.timeout(120)
async def test_a_revoked_drone_is_cut_off_and_refused_after_a_reload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """auth revoke DRONE, then a configuration reload: only that drone loses the bus"""
    authority, server_config = tmp_path / "authority.json", tmp_path / "auth.conf"
    given = ["--authority", str(authority)]
    assert main(["auth", "init", *given, "--server-config", str(server_config)]) == 0
    creds = {name: tmp_path / f"{name}.creds" for name in (DRONE, OTHER, "manager")}
    for drone in (DRONE, OTHER):
        assert main(["auth", "drone", drone, *given, "--out", str(creds[drone])]) == 0
    assert main(["auth", "manager", *given, "--out", str(creds["manager"])]) == 0
    config = tmp_path / "server.conf"
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth.conf"\n')
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:
        closed = asyncio.Event()

        async def on_close() -> None:
            closed.set()

        async def quiet(err: Exception) -> None:
            pass

        def drone(name: str, **options: Any) -> Any:
            return connect(
                server.url,
                user_credentials=str(creds[name]),
                inbox_prefix=f"_INBOX_{name}",
                error_cb=quiet,
                **options,
            )

        revoked = await drone(DRONE, closed_cb=on_close, max_reconnect_attempts=2)
        other = await drone(OTHER)
        manager = await connect(server.url, user_credentials=str(creds["manager"]))
        try:
            await provision(manager.jetstream())
            await revoked.publish(NS.event(SITE, DRONE, "heartbeat"), b"x")
            await revoked.flush()

            capsys.readouterr()
            assert (
                main(["auth", "revoke", DRONE, *given, "--server-config", str(server_config)]) == 0
            )
            assert "revoked 1 credentials" in capsys.readouterr().err
            assert main(["auth", "revoke", "site1-unknown", *given]) == 1
            assert server.pid is not None
            os.kill(server.pid, signal.SIGHUP)  # systemctl reload does this

            await asyncio.wait_for(closed.wait(), 30)  # cut off, and its reconnects refused
            with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
                await drone(DRONE, allow_reconnect=False, connect_timeout=2)
            # the other drone and the manager go on
            ack = await other.jetstream().publish(NS.event(SITE, OTHER, "heartbeat"), b"x")
            assert ack.stream == NS.event_stream and other.is_connected
            assert manager.is_connected
        finally:
            for client in (revoked, other, manager):
                await client.close()


@pytest.mark.timeout(120)
async def test_a_sites_bootstrap_identity_is_revoked_by_name_and_refused_after_a_reload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """
    What operations.md promises: ``auth bootstrap SITE`` makes the site's identity, named
    ``bootstrap-SITE``; ``auth revoke bootstrap-SITE`` and a reload refuse it. The issuer's
    key file (``auth issuer-key``) holds the account's signing key, none of the authority's
    other seeds, readable by its owner only.
    """
    authority, server_config = tmp_path / "authority.json", tmp_path / "auth.conf"
    given = ["--authority", str(authority)]
    assert main(["auth", "init", *given, "--server-config", str(server_config)]) == 0
    issuer_file, creds = tmp_path / "issuer-key.json", tmp_path / "bootstrap-site1.creds"
    assert main(["auth", "issuer-key", *given, "--out", str(issuer_file)]) == 0
    assert main(["auth", "bootstrap", SITE, *given, "--out", str(creds)]) == 0
    made = load_authority(authority)
    key = load_issuer_key(issuer_file)
    assert (key.account_public, key.account_signing) == (made.account_public, made.account_signing)
    assert made.operator not in issuer_file.read_text()
    assert made.account not in issuer_file.read_text()
    assert issuer_file.stat().st_mode & 0o777 == creds.stat().st_mode & 0o777 == 0o600
    assert creds_claims(creds.read_text())["name"] == f"bootstrap-{SITE}"

    config = tmp_path / "server.conf"
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth.conf"\n')
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:

        async def quiet(err: Exception) -> None:
            pass

        def site() -> Any:
            return connect(
                server.url,
                user_credentials=str(creds),
                inbox_prefix=f"_BOOTSTRAP_{SITE}",
                error_cb=quiet,
                allow_reconnect=False,
                connect_timeout=2,
            )

        await close(await site())  # accepted before the revocation
        capsys.readouterr()
        revoking = ["auth", "revoke", f"bootstrap-{SITE}", *given]
        assert main([*revoking, "--server-config", str(server_config)]) == 0
        assert "revoked 1 credentials" in capsys.readouterr().err
        assert server.pid is not None
        os.kill(server.pid, signal.SIGHUP)  # systemctl reload does this
        deadline = time.monotonic() + 30
        while True:  # the reload is asynchronous: refused once it took effect
            try:
                await close(await site())
            except nats.errors.Error as err:
                assert re.search(r"(?i)authorization violation", str(err)), err
                break
            assert time.monotonic() < deadline, "still accepted after the reload"
            await asyncio.sleep(0.2)
