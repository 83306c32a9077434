"""
TARDIS's own HTCondor adapters in front of the emulated site, for the integration tests

:func:`htcondor_site` sets up fake condor tools before an emulated local batch system and
overlay pool, configured as ``deploy/cobald/htcondor.yaml`` is;
:class:`HTCondorDrone` is a real TARDIS drone on those adapters, wrapped by the decorators.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tardis.adapters.batchsystems.htcondor import HTCondorAdapter as HTCondorBatchAdapter
from tardis.adapters.sites.htcondor import HTCondorAdapter as HTCondorSiteAdapter
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.configuration.configuration import Configuration
from tardis.interfaces.siteadapter import SiteAdapter
from tardis.resources.drone import Drone

from broker.emulation.execution_point import install_fake_condor
from broker.emulation.groundtruth import GroundTruth
from broker.emulation.site.collector import install_fake_collector
from broker.emulation.site.lbs import Job, LocalBatchSystem
from broker.emulation.site.overlay import OverlayPool
from broker.emulation.site.schedd import install_fake_schedd
from broker.tardis_adapter import RemoteBatchSystemAdapter, RemoteBus, RemoteSiteAdapter
from remote_agent.deploy_files import DEPLOY_DIR
from support.buses import Transitions
from support.waiting import wait_until

DEPLOY_COBALD = DEPLOY_DIR / "cobald"


SiteFactory = Callable[[float], Awaitable[LocalBatchSystem]]


@contextlib.asynccontextmanager
async def htcondor_site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[SiteFactory]:
    """
    The site and the overlay pool as TARDIS's own HTCondor adapters see them, configured
    like ``deploy/cobald/htcondor.yaml``: fake schedd tools
    (``broker/emulation/site/schedd.py``) in
    front of an emulated local batch system whose jobs run ``deploy/cobald/drone-job``
    (the real agent around an emulated startd with the real hooks), and fake collector
    tools (``broker/emulation/site/collector.py``) in front of an emulated overlay pool that offers
    3-second payloads to every startd; all on the ``PATH`` of TARDIS's ``ShellExecutor``
    """
    script = Path(sys.executable).parent / "cobald-remote"
    assert script.is_file(), "the cobald-remote command of this environment"
    running: list[tuple[LocalBatchSystem, OverlayPool, list[GroundTruth]]] = []

    def launch(job: Job) -> tuple[list[str], dict[str, str]]:
        # the drone job drone.jdl names, as it is installed on the worker nodes
        assert job.executable == "/usr/libexec/cobald-remote/drone-job"
        env = install_fake_condor(job.sandbox / "bin", job.sandbox / "ep", slots=1)
        env.update(job.env)  # what TARDIS and the decorators put in the submit description
        env.update(
            COBALD_REMOTE=str(script),
            COBALD_REMOTE_SPOOL_DIR=str(job.sandbox / "spool"),
            _CONDOR_SCRATCH_DIR=str(job.sandbox),  # the batch job's, for the drone's HTCondor
            COBALD_REMOTE_POLL_S="0.2",
            COBALD_REMOTE_HEARTBEAT_S="5",
            COBALD_REMOTE_END_GRACE_S="2",
        )
        return [str(DEPLOY_COBALD / "drone-job")], env

    async def start(queue_delay_s: float) -> LocalBatchSystem:
        truths = [GroundTruth(tmp_path / "lbs.jsonl"), GroundTruth(tmp_path / "obs.jsonl")]
        overlay = OverlayPool(tmp_path / "obs", lambda _: 3.0, truths[1])
        lbs = LocalBatchSystem(
            tmp_path / "lbs",
            launch,
            lambda _: queue_delay_s,
            truths[0],
            on_start=lambda job: overlay.join(job.drone, job.sandbox / "ep"),
            on_end=lambda job: overlay.leave(job.drone),
        )
        await overlay.start()
        await lbs.start()
        running.append((lbs, overlay, truths))
        tools = [
            install_fake_schedd(tmp_path / "schedd-bin", lbs.socket),
            install_fake_collector(tmp_path / "collector-bin", overlay.socket),
        ]
        monkeypatch.setenv("PATH", os.pathsep.join([*map(str, tools), os.environ["PATH"]]))
        Configuration().update_config(
            {
                "BatchSystem": {
                    "adapter": "HTCondor",
                    "max_age": 0.5,  # minutes: condor_status is cached for 30 s
                    "ratios": {"cpu_ratio": "Real(TotalSlotCpus-Cpus)/TotalSlotCpus"},
                },
                "Sites": [
                    {
                        "name": "Site1",
                        "adapter": "HTCondor",
                        "quota": 1,
                        "drone_heartbeat_interval": 1,
                    }
                ],
                "Site1": {
                    "MachineTypes": ["m1"],
                    "MachineTypeConfiguration": {"m1": {"jdl": str(DEPLOY_COBALD / "drone.jdl")}},
                    "MachineMetaData": {"m1": {"Cores": 1, "Memory": 1, "Disk": 1}},
                    "bulk_delay": 0.1,
                },
            }
        )
        return lbs

    Configuration._shared_state.clear()
    SiteAdapter.site_configuration.fget.cache_clear()
    try:
        yield start
    finally:
        for lbs, overlay, truths in running:
            await overlay.close()
            await lbs.close()
            for truth in truths:
                truth.close()
        Configuration._shared_state.clear()
        SiteAdapter.site_configuration.fget.cache_clear()


@dataclass
class HTCondorDrone:
    """A real TARDIS drone on TARDIS's own HTCondor adapters, wrapped by the decorators"""

    drone: Drone
    site: RemoteSiteAdapter
    batch: RemoteBatchSystemAdapter
    states: Transitions

    @classmethod
    def make(cls, bus: RemoteBus) -> HTCondorDrone:
        site = RemoteSiteAdapter(HTCondorSiteAdapter("m1", "Site1"), bus)
        batch = RemoteBatchSystemAdapter(HTCondorBatchAdapter(), bus)
        states = Transitions()
        drone = Drone(
            site_agent=SiteAgent(site), batch_system_agent=BatchSystemAgent(batch), plugins=[states]
        )
        return cls(drone, site, batch, states)

    @property
    def uuid(self) -> str:
        return str(self.drone.resource_attributes.drone_uuid)

    async def let_go_in(
        self, state: str, before: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Run it; once it reaches ``state`` (and ``before`` is done) COBalD lets it go"""
        task = asyncio.create_task(self.drone.run())
        try:
            await wait_until(lambda: state in self.states.states, 90, state)
            if before is not None:
                await before()
            self.drone.demand = 0
            await asyncio.wait_for(task, 120)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert self.states.states[-1] == "DownState"
