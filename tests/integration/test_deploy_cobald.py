"""
deploy/cobald: every COBalD/TARDIS configuration loads with COBalD's own machinery and
builds TARDIS wrapped in the decorators; the real daemon starts with it; the drone job
template and script run the agent as documented
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import htcondor2
import pytest
from cobald.composite.factory import FactoryPool
from cobald.controller.linear import LinearController
from cobald.daemon.core.config import load
from cobald.decorator.limiter import Limiter
from nats.js import JetStreamContext
from support.agent import read_events
from support.processes import start_process
from tardis.adapters.batchsystems.htcondor import HTCondorAdapter as HTCondorBatchAdapter
from tardis.adapters.sites.htcondor import HTCondorAdapter as HTCondorSiteAdapter
from tardis.configuration.configuration import Configuration
from tardis.interfaces.siteadapter import SiteAdapter
from tardis.plugins.sqliteregistry import SqliteRegistry
from tardis.utilities.attributedict import AttributeDict

from broker.emulation.demo.demand import DEMAND_RECORD, DemandRecorder
from broker.emulation.demo.scenario import Scenario
from broker.emulation.demo.template import render_config
from broker.emulation.execution_point import install_fake_condor
from broker.emulation.groundtruth import read_ground_truth
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from broker.tardis_adapter import (
    RemoteBatchSystemAdapter,
    RemoteFactoryPool,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol import events as ev

pytestmark = pytest.mark.timeout(120)

DEPLOY = DEPLOY_DIR / "cobald"


@pytest.fixture
def fresh_tardis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TARDIS's configuration is a process-wide Borg: empty it around each load"""
    monkeypatch.chdir(tmp_path)  # SqliteRegistry's db_file is relative to the daemon's cwd
    Configuration._shared_state.clear()
    SiteAdapter.site_configuration.fget.cache_clear()
    yield
    Configuration._shared_state.clear()
    SiteAdapter.site_configuration.fget.cache_clear()


def _pipeline(config: dict[Any, Any]) -> list[Any]:
    """The built pipeline from what ``cobald.daemon.core.config.load`` yields (keyed by plugin)"""
    [pipeline] = [value for plugin, value in config.items() if plugin.section == "pipeline"]
    return list(pipeline)


def _pools(pipeline: list[Any]) -> list[Any]:
    """The FactoryPools under TARDIS's composite (WeightedComposite > Standardiser > ...)"""
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, FactoryPool):
            found.append(node)
            return
        for child in getattr(node, "children", []) or []:
            walk(child)
        if hasattr(node, "target"):
            walk(node.target)

    walk(pipeline[-1])
    return found


def test_every_config_is_covered() -> None:
    names = {p.name for p in DEPLOY.iterdir()}
    assert names == {"htcondor.yaml", "demo.yaml", "drone.jdl", "drone-job"}


async def test_the_htcondor_config_builds_tardis_with_the_decorators(fresh_tardis: None) -> None:
    with load(str(DEPLOY / "htcondor.yaml")) as config:
        [pool] = _pools(_pipeline(config))
        assert isinstance(pool, RemoteFactoryPool)
        assert pool.interval == 30
        site_agent = pool.factory.keywords["site_agent"]
        batch_agent = pool.factory.keywords["batch_system_agent"]
        site = site_agent._site_adapter
        batch = batch_agent._batch_system_adapter
        assert isinstance(site, RemoteSiteAdapter)
        assert isinstance(site.inner, HTCondorSiteAdapter)
        assert isinstance(batch, RemoteBatchSystemAdapter)
        assert isinstance(batch.inner, HTCondorBatchAdapter)
        plugins = pool.factory.keywords["plugins"]
        assert [type(p) for p in plugins] == [SqliteRegistry, TardisStateNotes]
        bus = pool.bus
        assert bus is not None and site.bus_site == pool.site == "mysite"
        assert len(bus.config.servers) == 3
        assert bus.config.drone_servers == ("nats://nats-leaf.site.example.org:4222",)
        assert (bus.config.lost_after_s, bus.config.drain_deadline_s) == (90.0, 86400.0)
        # TARDIS's own settings are untouched
        assert site.drone_heartbeat_interval == 60
        assert site.machine_meta_data["Cores"] == 8


class SubmitRecorder:
    """A TARDIS executor that records ``condor_submit``'s input and answers like it"""

    def __init__(self) -> None:
        self.stdin: list[str] = []

    async def run_command(self, command: str, stdin_input: str | None = None) -> AttributeDict:
        self.stdin.append(stdin_input or "")
        return AttributeDict(stdout="** Proc 42.0:\n", stderr="", exit_code=0)


async def test_the_drone_jdl_passes_the_agents_settings(fresh_tardis: None) -> None:
    with load(str(DEPLOY / "htcondor.yaml")) as config:
        [pool] = _pools(_pipeline(config))
        bus = pool.bus
        site_config = Configuration().MySite
        site_config.MachineTypeConfiguration.wn8.jdl = str(DEPLOY / "drone.jdl")
        site_config.executor = recorder = SubmitRecorder()
        site_config.bulk_delay = 0.01
        adapter = RemoteSiteAdapter(HTCondorSiteAdapter("wn8", "MySite"), bus)
        attributes = AttributeDict(
            drone_uuid="mysite-0123456789",
            obs_machine_meta_data_translation_mapping=AttributeDict(
                Cores=1, Memory=1024, Disk=1024 * 1024
            ),
        )
        answer = await adapter.deploy_resource(attributes)
        assert answer.remote_resource_uuid == "42.0"
    [jdl] = recorder.stdin
    lines = dict(line.split(" = ", 1) for line in jdl.splitlines() if " = " in line)
    environment = dict(item.split("=", 1) for item in lines["environment"].split(";"))
    assert environment["TardisDroneUuid"] == "mysite-0123456789"
    assert environment["TardisDroneCobaldRemoteUrl"] == "nats://nats-leaf.site.example.org:4222"
    assert environment["TardisDroneCobaldRemoteSite"] == "mysite"
    assert environment["TardisDroneCobaldRemotePrefix"] == "cobald"
    assert lines["request_cpus"] == "8" and lines["request_memory"] == "16384"
    assert lines["output"] == "drone.$(Cluster).$(Process).out"
    # HTCondor's own submit-description reader (the htcondor wheel) accepts it as TARDIS wrote it
    submit = htcondor2.Submit(jdl)
    assert submit["executable"] == "/usr/libexec/cobald-remote/drone-job"
    assert "TardisDroneCobaldRemoteSite=mysite" in submit["environment"].split(";")
    assert submit.expand("output") != submit["output"]  # $(Cluster) is left to HTCondor


@pytest.mark.parametrize("adapters", ["emulated", "htcondor", "slurm"])
@pytest.mark.parametrize("bus", [True, False], ids=["with-bus", "stock"])
async def test_the_demo_config_builds(
    fresh_tardis: None, tmp_path: Path, bus: bool, adapters: str
) -> None:
    section = {"servers": "nats://127.0.0.1:4222", "lost_after_s": 10} if bus else None
    path = tmp_path / "demo.yaml"
    scenario = Scenario(tardis_adapters=adapters, demand="scripted")
    path.write_text(render_config(scenario, tmp_path, start=0.0, bus=section))
    with load(str(path)) as config:
        [pool] = _pools(_pipeline(config))
        assert isinstance(pool, RemoteFactoryPool) is bus
        assert pool.interval == 1.0
        site = pool.factory.keywords["site_agent"]._site_adapter
        assert isinstance(site, RemoteSiteAdapter) is bus
        inner = site.inner if isinstance(site, RemoteSiteAdapter) else site
        assert isinstance(inner, HTCondorSiteAdapter) is (adapters == "htcondor")
        assert _pipeline(config)[0].schedule[0] == [0.0, 4.0]
    with pytest.raises(ValueError, match="tardis_adapters must be emulated, htcondor or slurm"):
        render_config(Scenario(tardis_adapters="moab"), tmp_path, start=0.0, bus=section)


async def test_the_demo_config_builds_cobalds_controller(
    fresh_tardis: None, tmp_path: Path
) -> None:
    """``demo --demand controller``: TARDIS's example pipeline, the interval scaled"""
    path = tmp_path / "demo.yaml"
    scenario = Scenario(demand="controller")
    path.write_text(render_config(scenario, tmp_path, start=0.0, bus=None))
    with load(str(path)) as config:
        controller, limiter, recorder, top = _pipeline(config)
        assert isinstance(controller, LinearController)
        assert (controller.low_utilisation, controller.high_allocation) == (0.9, 0.9)
        assert (controller.rate, controller.interval) == (1.0, 1 / 30)
        assert isinstance(limiter, Limiter) and limiter.minimum == 1
        assert isinstance(recorder, DemandRecorder)
        assert recorder.path == tmp_path / DEMAND_RECORD
        [pool] = _pools([top])
        # the site's quota bounds the controller's demand: the scenario's most drones
        [site] = top.children
        assert site.maximum == scenario.max_drones * scenario.slots
        assert pool.interval == 1.0


async def test_the_real_daemon_runs_the_htcondor_config(tmp_path: Path) -> None:
    log = tmp_path / "cobald.log"
    proc = await start_process(
        sys.executable,
        "-m",
        "cobald.daemon",
        str(DEPLOY / "htcondor.yaml"),
        "--log-target",
        str(log),
        cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for _ in range(600):
            text = log.read_text() if log.exists() else ""
            # stop it once its first connection attempt is over: a pending name lookup
            # would hold up asyncio's shutdown
            if "manager session failed" in text or proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert "cobald-remote bus for TARDIS: nats://nats1.example.org:4222" in text, text
        assert proc.returncode is None  # built and running (the bus retries its servers)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in log.read_text()
    assert (tmp_path / "drone_registry.db").exists()


async def _kinds(js: JetStreamContext, drone: str) -> list[str]:
    return [ev.kind_of(type(event)) for _, event in await read_events(js, drone, site="mysite")]


async def test_the_drone_job_runs_the_agent_around_the_master(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    drone = "mysite-00000000d7"
    env = install_fake_condor(tmp_path / "bin", tmp_path / "ep", slots=1)
    env.update(
        {
            # what TARDIS and the decorators put into the job's environment
            "TardisDroneUuid": drone,
            "TardisDroneCores": "1",
            "TardisDroneCobaldRemoteUrl": nats_server.url,
            "TardisDroneCobaldRemoteSite": "mysite",
            "TardisDroneCobaldRemotePrefix": "cobald",
            "COBALD_REMOTE": str(Path(sys.executable).parent / "cobald-remote"),
            "COBALD_REMOTE_SPOOL_DIR": str(tmp_path / "spool"),
            "COBALD_REMOTE_POLL_S": "0.5",
            "_CONDOR_SCRATCH_DIR": str(tmp_path),  # the batch job's, for the drone's HTCondor
        }
    )
    proc = await start_process(
        DEPLOY / "drone-job",
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            seen = await _kinds(js, drone)
            if "gate_opened" in seen:
                break
            await asyncio.sleep(0.1)
        assert {"agent_started", "worker_started", "startd_ready", "gate_opened"} <= set(seen)
    finally:
        proc.send_signal(signal.SIGTERM)  # the batch system ends the job
        code = await asyncio.wait_for(proc.wait(), 60)
    assert code == 0
    assert "agent_exiting" in await _kinds(js, drone)
    truth = read_ground_truth(tmp_path / "ep" / "ground_truth.jsonl")
    assert truth[-1]["event"] == "master_exiting"  # the master ended with the job
