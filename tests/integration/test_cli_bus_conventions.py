"""The operator commands against a real server: the NATS variables, --json, refused permissions"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import pytest
from support.processes import CLI, run_process
from support.servers import drone_creds

from broker.cli import main
from broker.commands.options import connected
from broker.errors import OperatorError
from broker.server.auth.revocation import issued_users
from broker.server.embedded import EmbeddedServer

SITE, DRONE = "site1", "site1-0123456789"
STREAMS = ("COBALD_EVENTS", "KV_cobald-drones", "KV_cobald-manager", "KV_cobald-grants")


def _env(**bus: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COBALD_REMOTE_", "NATS_"))}
    return env | bus


async def test_a_drones_credentials_are_refused_as_such_not_as_no_jetstream(
    secured: tuple[EmbeddedServer, Path], tmp_path: Path
) -> None:
    server, authority = secured
    creds = drone_creds(tmp_path, authority, SITE, DRONE)
    env = _env(NATS_URL=server.url, NATS_CREDS=str(creds))
    for argv in (["broker", "init"], ["status"], ["timeline", DRONE]):
        code, out, err = await run_process(*CLI, *argv, env=env)
        assert (code, out) == (1, ""), argv
        assert "permissions violation for publish" in err, argv
        assert "need the manager's credentials" in err, argv
        assert "JetStream" not in err.split(":")[-1], argv


async def test_a_refused_subject_ends_the_request_at_once_not_at_its_timeout(
    secured: tuple[EmbeddedServer, Path], tmp_path: Path
) -> None:
    server, authority = secured
    args = argparse.Namespace(
        server=server.url, creds=str(drone_creds(tmp_path, authority, SITE, DRONE))
    )

    async def ask_jetstream() -> None:
        async with connected(args, "test") as nc:
            await nc.request("$JS.API.INFO", b"", timeout=600)

    with pytest.raises(OperatorError) as refusal:
        await asyncio.wait_for(ask_jetstream(), 60)  # a tenth of the request's timeout
    assert str(refusal.value) == (  # nats-py lower-cases the server's error (protocol/parser.py)
        'nats: permissions violation for publish to "$js.api.info": these commands need the '
        "manager's credentials (--creds; cobald-remote auth manager)"
    )
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the cancel it made is taken back


async def test_broker_init_prints_json_and_reads_the_bus_from_the_environment(
    secured: tuple[EmbeddedServer, Path], tmp_path: Path
) -> None:
    server, _ = secured
    manager = str(tmp_path / "manager.creds")
    env = _env(COBALD_REMOTE_URL=server.url, NATS_URL="nats://127.0.0.1:1", NATS_CREDS=manager)
    code, out, err = await run_process(*CLI, "broker", "init", "--json", env=env)
    assert (code, err) == (0, "")
    assert json.loads(out) == dict.fromkeys(STREAMS, "unchanged")
    code, _, err = await run_process(*CLI, "broker", "init", env=_env(NATS_URL=server.url))
    assert code == 1
    assert "refused the credentials" in err  # NATS_CREDS not set: none given


def test_auth_commands_print_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    given = ["--authority", str(tmp_path / "authority.json"), "--json"]
    assert main(["auth", "init", *given]) == 0
    out, err = capsys.readouterr()
    init = json.loads(out)
    assert err == ""
    assert init["operator"].startswith("O") and init["account"].startswith("A")
    assert init["server_config"].startswith("# cobald-remote authority") and init["out"] is None

    out_file = tmp_path / "drone.creds"
    assert main(["auth", "drone", DRONE, *given, "--out", str(out_file)]) == 0
    drone = json.loads(capsys.readouterr().out)
    assert drone["name"] == f"drone-{DRONE}" and drone["creds"] is None
    assert drone["out"] == str(out_file) and out_file.stat().st_mode & 0o777 == 0o600
    assert drone["expires_at"] > drone["issued_at"]
    assert issued_users(tmp_path / "authority.json", DRONE) == [drone["user"]]

    assert main(["auth", "leaf", SITE, *given]) == 0
    leaf = json.loads(capsys.readouterr().out)
    assert leaf["account"] == init["account"] and leaf["expires_at"] is None
    assert leaf["creds"].startswith("-----BEGIN NATS USER JWT-----")

    assert main(["auth", "manager", *given]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "manager"

    key_file = tmp_path / "manager" / "issuer-key.json"  # its directory made, too
    assert main(["auth", "issuer-key", *given, "--out", str(key_file)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"out": str(key_file), "account": init["account"]}
    assert err == "" and key_file.stat().st_mode & 0o777 == 0o600

    assert main(["auth", "revoke", DRONE, *given]) == 0
    revoked = json.loads(capsys.readouterr().out)
    assert revoked["revoked"] == [drone["user"]]
    assert revoked["server_config"] != init["server_config"]  # the account JWT names the user
