"""
``cobald-remote selftest`` against a real nats-server and a running manager

It passes with bootstrapped and with per-drone credentials and leaves nothing of its drone
in the server; it fails at the right step with the right advice for wrong credentials, a
missing bucket (and following that advice makes it pass) and a manager that is not running.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nats
import pytest
from support.bootstrap import manager_settings, site_bootstrap
from support.manager import running_manager
from support.processes import CLI, run_process
from support.servers import drone_creds
from support.waiting import wait_until

from broker.manager.service import ManagerSettings
from broker.server.auth.authority import create_authority, load_authority, save_authority
from broker.server.auth.credentials import manager_credentials
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.protocol.names import Namespace, kv_stream

pytestmark = pytest.mark.timeout(180)
NS = Namespace()
SITE = "site1"


async def selftest(url: str, *options: str | Path) -> tuple[int, dict[str, Any], str]:
    """``cobald-remote selftest --json``: its exit code, its JSON, its stderr"""
    code, out, err = await run_process(
        *CLI, "selftest", "--server", url, "--json", *map(str, options), timeout_s=150
    )
    return code, (json.loads(out) if out.strip() else {}), err


def step(result: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in result["steps"] if s["name"] == name)
    return found


def failed_at(result: dict[str, Any]) -> str:
    """The one step that failed; every step before it passed, none after it ran"""
    oks = [s["ok"] for s in result["steps"]]
    at = oks.index(False)
    assert oks[:at] == [True] * at and oks[at + 1 :] == [None] * (len(oks) - at - 1), oks
    name: str = result["steps"][at]["name"]
    return name


async def nothing_left(url: str, creds: Path | None, drone: str) -> None:
    """No record, grant or event of ``drone`` in the server"""
    nc = await nats.connect(url, user_credentials=str(creds) if creds else None)
    try:
        js = nc.jetstream()
        for stream, subject in (
            (NS.event_stream, f"{NS.drone_root(SITE, drone)}.>"),
            (NS.record_stream, NS.record_subject(SITE, drone)),
            (kv_stream(NS.grant_bucket), f"$KV.{NS.grant_bucket}.{SITE}.{drone}"),
        ):
            info = await js.stream_info(stream, subjects_filter=subject)
            assert not info.state.subjects, (stream, info.state.subjects)
    finally:
        await nc.close()


def passed(code: int, result: dict[str, Any], err: str) -> None:
    assert (code, err) == (0, ""), ([s for s in result.get("steps", []) if s["ok"] is False], err)
    assert result["passed"] and all(s["ok"] for s in result["steps"]), result
    events = [row["drone_event"].split(" ")[0].rstrip(":") for row in result["timeline"]]
    assert events[0] == "agent_started" and {"gate_opened", "drained"} <= set(events), events
    assert result["timeline"][-1]["source"] == "manager"  # the end, as the manager decides it
    assert result["drone"].startswith("selftest-") and result["site"] == SITE


async def test_a_bootstrapped_stand_in_drone_lives_its_whole_life_and_leaves_nothing(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    manager = tmp_path / "manager.creds"
    bootstrap = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        code, result, err = await selftest(
            server.url, "--creds", manager, "--site", SITE, "--bootstrap-creds", bootstrap
        )
        passed(code, result, err)
        assert result["mode"] == "bootstrap"
        assert [s["name"] for s in result["steps"]] == [
            "server", "provisioned", "manager", "credentials", "agent", "enrolled",
            "claim", "events", "drain", "end", "timeline",
        ]  # fmt: skip
        assert service.issuer is not None and service.issuer.counts["issued_enroll"] == 1
        await wait_until(  # the running manager saw it end (at its next check)
            lambda: (
                (view := service.registry.view(SITE, result["drone"])) is not None
                and view.ended == "drained"
            ),
            30,
            "the drone's end at the manager",
        )
        await nothing_left(server.url, manager, result["drone"])
        assert len(result["remains"]) == 1 and "in memory" in result["remains"][0]


async def test_a_stand_in_drone_on_per_drone_credentials_passes_as_text(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    manager = tmp_path / "manager.creds"
    creds = drone_creds(tmp_path, authority, SITE, "selftest-0123456789")
    async with running_manager(manager_settings(tmp_path, server, authority)):
        code, out, err = await run_process(
            *CLI, "selftest", "--server", server.url, "--creds", str(manager),
            "--drone-creds", str(creds), timeout_s=150,
        )  # fmt: skip
    assert (code, err) == (0, ""), out
    lines = out.splitlines()
    assert lines[0] == "self-test of drone site1/selftest-0123456789 (drone-creds):"
    for name in ("server", "claim", "events", "drain", "end", "timeline"):
        assert any(line.split()[:2] == ["passed", name] for line in lines), (name, out)
    assert "TIME (UTC)" in out and lines[-1] == "PASSED"
    await nothing_left(server.url, manager, "selftest-0123456789")


async def test_wrong_manager_credentials_are_named(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    # a drone's credentials where the manager's belong: connected, but refused JetStream
    wrong = drone_creds(tmp_path, authority, SITE, "site1-0123456789")
    code, result, _ = await selftest(server.url, "--creds", wrong, "--site", SITE)
    assert code == 1 and failed_at(result) == "provisioned", result
    fix = step(result, "provisioned")["fix"]
    assert f"--creds {wrong} are not the manager's" in fix and "auth manager" in fix
    # the manager's credentials of another installation: refused at the connect
    other_authority = tmp_path / "other-authority.json"
    save_authority(create_authority(), other_authority)
    stranger = tmp_path / "stranger.creds"
    stranger.write_text(manager_credentials(load_authority(other_authority)))
    code, result, _ = await selftest(server.url, "--creds", stranger, "--site", SITE)
    assert code == 1 and failed_at(result) == "server", result
    fix = step(result, "server")["fix"]
    assert f"the server does not accept --creds {stranger}" in fix and "auth manager" in fix


async def test_wrong_drone_credentials_are_named(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    manager = tmp_path / "manager.creds"
    # a real drone's: refused before anything is written, since the test would drain it
    real = drone_creds(tmp_path, authority, SITE, "site1-0123456789")
    code, result, err = await selftest(server.url, "--creds", manager, "--drone-creds", real)
    assert (code, result) == (1, {})
    assert "credentials of drone 'site1-0123456789', which is not a self-test drone" in err
    assert "cobald-remote auth drone selftest-0123456789 --site site1" in err
    # another site's bootstrap credentials than the drone's
    other = site_bootstrap(tmp_path, authority, "site2")
    async with running_manager(manager_settings(tmp_path, server, authority)):
        code, result, _ = await selftest(
            server.url, "--creds", manager, "--site", SITE, "--bootstrap-creds", other
        )
    assert code == 1 and failed_at(result) == "credentials", result
    fix = step(result, "credentials")["fix"]
    assert "site site1's bootstrap credentials: cobald-remote auth bootstrap site1" in fix


async def test_a_missing_bucket_is_named_and_the_advice_mends_it(
    tmp_path: Path, nats_server: EmbeddedServer
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await provision(nc.jetstream())
        await nc.jetstream().delete_stream(NS.record_stream)
    finally:
        await nc.close()
    settings = ManagerSettings(servers=[nats_server.url], retry_s=0.2)
    code, result, _ = await selftest(nats_server.url, "--site", SITE)
    assert code == 1 and failed_at(result) == "provisioned", result
    provisioned = step(result, "provisioned")
    assert provisioned["detail"] == f"missing on {nats_server.url}: {NS.record_stream}"
    advice = provisioned["fix"]
    assert advice == f"run cobald-remote broker init --server {nats_server.url}"
    code, out, err = await run_process(*CLI, *advice.removeprefix("run cobald-remote ").split())
    assert code == 0, (out, err)
    async with running_manager(settings):
        code, result, err = await selftest(nats_server.url, "--site", SITE)
    passed(code, result, err)
    assert result["mode"] == "anonymous" and "anonymous" in step(result, "credentials")["detail"]


async def test_a_manager_that_is_not_running_is_named(
    tmp_path: Path, nats_server: EmbeddedServer
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await provision(nc.jetstream())
    finally:
        await nc.close()
    code, result, _ = await selftest(nats_server.url, "--site", SITE)
    assert code == 1 and failed_at(result) == "manager", result
    assert "start the manager" in step(result, "manager")["fix"]
    # a manager that ran once and is gone: its consumer stays, nobody reads it
    async with running_manager(ManagerSettings(servers=[nats_server.url], retry_s=0.2)):
        pass
    code, result, _ = await selftest(nats_server.url, "--site", SITE, "--timeout", "5")
    assert code == 1 and failed_at(result) == "events", result
    assert "the manager is not running" in step(result, "events")["fix"]
    assert result["remains"] and "in memory" in result["remains"][-1]
    await nothing_left(nats_server.url, None, result["drone"])
