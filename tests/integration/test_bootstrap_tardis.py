"""
Bootstrap tokens through the real decorated TARDIS site adapter, on a nats-server in operator mode

TARDIS's own HTCondor site adapter, wrapped by :class:`RemoteSiteAdapter` with
``bus.bootstrap_key`` set, submits through fake condor tools: each drone's job
carries its own one-time token (and no other drone's, and not the bus's shared
environment), an agent started with that environment bootstraps, and a deploy while
the bus is not connected fails as TARDIS retries it, minting nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.agent import SLEEPER, running
from support.bootstrap import Asker, issuer_key, site_bootstrap, up
from support.htcondor import HTCondorDrone, SiteFactory, htcondor_site
from support.tardis import attributes
from support.waiting import wait_until
from tardis.adapters.sites.htcondor import HTCondorAdapter as HTCondorSiteAdapter
from tardis.exceptions.tardisexceptions import TardisResourceStatusUpdateFailed

from broker.manager.grants import GrantStore
from broker.server.embedded import EmbeddedServer
from broker.tardis_adapter import BusConfig, RemoteBus, RemoteSiteAdapter
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import Issued, token_hash
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace
from remote_agent.settings import TARDIS_SETTINGS_ENV, Settings

pytestmark = pytest.mark.timeout(180)
NS = Namespace()
SITE = "site1"
TOKEN_ENV = TARDIS_SETTINGS_ENV["token"]
CREDS_ENV = TARDIS_SETTINGS_ENV["bootstrap_creds"]
MAPPING = attributes().obs_machine_meta_data_translation_mapping


@pytest.fixture
async def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SiteFactory]:
    async with htcondor_site(tmp_path, monkeypatch) as start:
        yield start


def bus_config(tmp_path: Path, server: EmbeddedServer, authority: Path) -> BusConfig:
    site_bootstrap(tmp_path, authority)  # where the drones find it: bootstrap-site1.creds
    return BusConfig.from_mapping(
        {
            "servers": server.url,
            "creds": str(tmp_path / "manager.creds"),
            "lost_after_s": 10.0,
            "request_timeout_s": 5.0,
            "drain_deadline_s": 60.0,
            "bootstrap_key": str(issuer_key(tmp_path, authority)),
            "bootstrap_creds": str(tmp_path / "bootstrap-{site}.creds"),
        }
    )


@contextlib.asynccontextmanager
async def running_bus(bus: RemoteBus) -> AsyncIterator[RemoteBus]:
    """The bus as COBalD runs it, connected; stopped at the end"""
    task = asyncio.create_task(bus.run())
    try:
        assert await bus.wait_ready(30), "the bus did not connect"
        yield bus
    finally:
        bus.stop()
        await asyncio.wait_for(task, 30)


async def grant_hash(server: EmbeddedServer, tmp_path: Path, drone: str) -> str | None:
    """The token hash the grants bucket holds for ``drone``, read as the manager"""
    nc = await connect(server.url, user_credentials=str(tmp_path / "manager.creds"))
    try:
        found = await (await GrantStore.open(nc.jetstream(), NS)).get(SITE, drone)
    finally:
        await close(nc)
    return None if found is None else found[0].token_hash


def agent_from(tmp_path: Path, env: dict[str, str]) -> Agent:
    """The agent as the drone job starts it: everything from the job's environment"""
    drone = env["TardisDroneUuid"]
    settings = Settings.from_env(
        env,
        worker_command=SLEEPER,
        spool_dir=tmp_path / f"spool-{drone}",
        gate_socket=tmp_path / f"gate-{drone}.sock",
        startd=False,
    )
    return Agent(
        replace(settings, poll_s=0.05, end_grace_s=0.2, reconnect_wait_s=0.1, exit_flush_s=1.0)
    )


async def test_each_submitted_drone_gets_its_own_token_in_its_job_and_bootstraps(
    tmp_path: Path,
    secured: tuple[EmbeddedServer, Path],
    site: SiteFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, authority = secured
    lbs = await site(600.0)  # the jobs stay queued; the agent runs here
    async with running_bus(
        RemoteBus(bus_config(tmp_path, server, authority), register=False)
    ) as bus:
        adapter = RemoteSiteAdapter(HTCondorSiteAdapter("m1", "Site1"), bus)
        drones = ["site1-00000000aa", "site1-00000000bb", "site1-00000000cc"]
        # at once, as TARDIS deploys its drones (its condor_submit calls are batched)
        await asyncio.gather(*(adapter.deploy_resource(attributes(drone)) for drone in drones))
        jobs = {job.drone: job for job in lbs.jobs.values()}
        assert sorted(jobs) == drones
        # what condor_submit received: each job its own token, the site's creds path
        tokens = {drone: jobs[drone].env[TOKEN_ENV] for drone in drones}
        assert len(set(tokens.values())) == len(drones)
        for drone, token in tokens.items():
            assert jobs[drone].env[CREDS_ENV] == str(tmp_path / "bootstrap-site1.creds")
            assert await grant_hash(server, tmp_path, drone) == token_hash(token)
            assert token not in str(adapter.drone_environment(drone, MAPPING))
        shared = bus.drone_environment(SITE)
        assert not any(TOKEN_ENV.endswith(key) for key in shared), shared
        assert not any(token in str(shared) for token in tokens.values())
        # the first drone's job starts: its agent bootstraps from that environment alone
        agent = agent_from(tmp_path, dict(jobs[drones[0]].env))
        assert agent.settings.creds is None and agent.settings.bootstrap_token == tokens[drones[0]]
        async with running(agent) as run:
            await wait_until(lambda: up(bus.registry, drones[0]), 30, "the drone's events")
            assert agent.gate_open
            assert await run.stop() == 128 + 15
        assert bus.manager.issuer_counts["issued_enroll"] == 1
        assert not any(key.startswith("refused_") for key in bus.manager.issuer_counts)
        # the second job's token read off the queue (condor_q -l) and used before it starts:
        # the thief has that one drone's identity, and the real drone's bootstrap alarms
        thief = Asker(server.url, tmp_path / "bootstrap-site1.creds").with_key(9)
        assert isinstance(await thief.ask(thief.enroll(drones[1], tokens[drones[1]])), Issued)
        robbed = agent_from(tmp_path, dict(jobs[drones[1]].env))
        with caplog.at_level(logging.ERROR):
            async with running(robbed) as run:
                await wait_until(lambda: "ALARM" in caplog.text, 30, "the alarm")
                await wait_until(lambda: "reused" in caplog.text, 30, "the agent's refusal")
                assert not robbed.gate_open
                assert await run.stop() == 128 + 15
        assert bus.manager.issuer_counts["alarms"] == 1
        assert bus.manager.issuer_counts["refused_reused"] == 1
        assert not up(bus.registry, drones[1])


async def test_a_deploy_while_the_bus_is_not_connected_fails_as_tardis_retries_it(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], site: SiteFactory
) -> None:
    server, authority = secured
    lbs = await site(600.0)
    bus = RemoteBus(bus_config(tmp_path, server, authority), register=False)  # not running
    adapter = RemoteSiteAdapter(HTCondorSiteAdapter("m1", "Site1"), bus)
    drone = "site1-00000000aa"
    with pytest.raises(TardisResourceStatusUpdateFailed, match="not connected"):
        await adapter.deploy_resource(attributes(drone))
    assert adapter.counts["deploy_resource_failed"] == 1
    assert not lbs.jobs  # nothing submitted
    assert TOKEN_ENV.removeprefix("TardisDrone") not in str(
        adapter.drone_environment(drone, MAPPING)
    )
    assert await grant_hash(server, tmp_path, drone) is None  # nothing minted
    # TARDIS tries again later, once the bus is connected
    async with running_bus(bus):
        await adapter.deploy_resource(attributes(drone))
    [job] = lbs.jobs.values()
    assert await grant_hash(server, tmp_path, drone) == token_hash(job.env[TOKEN_ENV])


async def test_a_drone_tardis_submits_runs_its_whole_life_on_its_bootstrapped_identity(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], site: SiteFactory
) -> None:
    """TARDIS's drone, condor_submit, the drone job's real agent: enrolled, drained, gone"""
    server, authority = secured
    await site(0.5)
    async with running_bus(
        RemoteBus(bus_config(tmp_path, server, authority), register=False)
    ) as bus:
        tardis = HTCondorDrone.make(bus)

        async def enrolled_and_up() -> None:
            await wait_until(lambda: up(bus.registry, tardis.uuid), 60, "the drone's agent up")

        await tardis.let_go_in("AvailableState", before=enrolled_and_up)
        view = bus.registry.view(SITE, tardis.uuid)
        assert view is not None and view.phase is ev.RecordPhase.DRAINED
        assert bus.manager.issuer_counts["issued_enroll"] == 1
        assert not any(key.startswith("refused_") for key in bus.manager.issuer_counts)
