"""
Revoking credentials (broker/server/auth/revocation.py) against a real nats-server in operator
mode: the account JWT a running server reloads, what was issued and what expired, and a
revoked drone or site's bootstrap identity cut off and refused after a reload
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from support.agent import SITE

from broker.cli import main
from broker.errors import AuthError
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
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace

pytestmark = pytest.mark.timeout(120)
NS = Namespace()
DRONE = "site1-00000000aa"
OTHER = "site1-00000000bb"


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
        outcome: object = "accepted"
        while True:  # the reload is asynchronous: refused once it took effect
            try:
                await close(await site())
                outcome = "accepted"
            except nats.errors.Error as err:
                if re.search(r"(?i)authorization violation", str(err)):
                    break
                outcome = err
            except OSError as err:  # the server may close before its -ERR is read: ask again
                outcome = err
            assert time.monotonic() < deadline, f"not refused after the reload: {outcome!r}"
            await asyncio.sleep(0.2)


@pytest.mark.timeout(60)
async def test_a_sites_bootstrap_identity_connects_only_from_its_networks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``auth bootstrap --source``: the user JWT's ``src``, which every server checks"""
    authority, server_config = tmp_path / "authority.json", tmp_path / "auth.conf"
    given = ["--authority", str(authority)]
    assert main(["auth", "init", *given, "--server-config", str(server_config)]) == 0
    here, elsewhere = tmp_path / "here.creds", tmp_path / "elsewhere.creds"
    source = ["--source", "192.0.2.0/24", "--source", "2001:db8::/32"]
    assert main(["auth", "bootstrap", SITE, *given, *source, "--out", str(elsewhere)]) == 0
    assert (
        main(["auth", "bootstrap", SITE, *given, "--source", "127.0.0.1/8", "--out", str(here)])
        == 0
    )
    assert creds_claims(here.read_text())["nats"]["src"] == ["127.0.0.0/8"]
    assert main(["auth", "bootstrap", SITE, *given, "--source", "site1's nodes"]) == 1
    assert "not a network in CIDR notation" in capsys.readouterr().err

    config = tmp_path / "server.conf"
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth.conf"\n')
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:

        async def quiet(err: Exception) -> None:
            pass

        def site(creds: Path) -> Any:
            return connect(
                server.url,
                user_credentials=str(creds),
                inbox_prefix=f"_BOOTSTRAP_{SITE}",
                error_cb=quiet,
                allow_reconnect=False,
                connect_timeout=2,
            )

        await close(await site(here))  # the test connects from 127.0.0.1
        with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
            await site(elsewhere)
