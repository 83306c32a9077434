"""
Drones as real Slurm jobs: TARDIS's own SlurmAdapter (sbatch, squeue, scancel through its
ShellExecutor), wrapped by the decorators, against a real single-node Slurm
(``broker/emulation/site/slurm.py``); each job runs the shipped ``deploy/slurm/drone-job``:
the real agent around an emulated startd that joins the emulated overlay pool
(``broker/emulation/site/slurm_site.py``)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cobald.composite.factory import FactoryPool
from nats.js import JetStreamContext
from support.agent import read_events
from support.buses import BusFactory, Transitions
from support.slurm import requires_slurm
from support.tardis import drone_running
from support.waiting import wait_until
from tardis.adapters.batchsystems.htcondor import HTCondorAdapter as HTCondorBatchAdapter
from tardis.adapters.sites.slurm import SlurmAdapter
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.configuration.configuration import Configuration
from tardis.interfaces.siteadapter import SiteAdapter
from tardis.plugins.sqliteregistry import SqliteRegistry
from tardis.resources.drone import Drone

from broker.emulation.groundtruth import GroundTruth, read_ground_truth
from broker.emulation.site.collector import install_fake_collector
from broker.emulation.site.overlay import OverlayPool
from broker.emulation.site.slurm import PARTITION, SlurmCluster, slurm_cluster
from broker.emulation.site.slurm_site import SlurmSite
from broker.server.embedded import EmbeddedServer
from broker.tardis_adapter import (
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteFactoryPool,
    RemoteSiteAdapter,
    TardisStateNotes,
    create_composite_pool,
)
from remote_agent.batchsystem import parse_slurm_time
from remote_agent.interfaces import END_REFUSED_STATUS
from remote_agent.protocol import events as ev

pytestmark = [pytest.mark.timeout(240), requires_slurm]

SITE = "site1"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One real Slurm for every Slurm test; its daemons stopped by PID at the end"""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def _slurm_site(
    slurm: SlurmCluster,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    payload_s: float = 3.0,
    runtime_in_ad: bool = False,
    walltime_min: int = 60,
    signal: str | None = None,
    warning_grace_s: float | None = None,
) -> AsyncIterator[SlurmSite]:
    """
    The Slurm site and the overlay pool as TARDIS's Slurm and HTCondor adapters see them:
    the recorded Slurm clients and the fake collector tools on the ``PATH`` of TARDIS's
    ``ShellExecutor``, ``SLURM_CONF`` naming the test cluster; the overlay offers
    ``payload_s``-second payloads to every startd

    :param runtime_in_ad: each payload's job ad says how long it runs (``AllowedJobDuration``)
    :param walltime_min: the drones' time limit (TARDIS's ``Walltime``, ``sbatch --time``)
    :param signal: ``sbatch --signal`` of the drones, e.g. ``B:USR1@100``
    :param warning_grace_s: what the site's drone.env tells the agent that signal gives
    """
    slurm_site = SlurmSite(slurm, root / "site", warning_grace_s=warning_grace_s)
    slurm_site.write()
    truth = GroundTruth(root / "obs.jsonl")
    ad = (lambda job: {"AllowedJobDuration": job.duration_s}) if runtime_in_ad else None
    overlay = OverlayPool(root / "obs", lambda _: payload_s, truth, ad=ad)
    await overlay.start()
    Configuration._shared_state.clear()
    SiteAdapter.site_configuration.fget.cache_clear()
    tardis_site = slurm_site.tardis_site("m1", 1)
    machine = tardis_site["MachineTypeConfiguration"]["m1"]
    machine["Walltime"] = walltime_min
    if signal is not None:
        machine["SubmitOptions"]["long"]["signal"] = signal
    try:
        async with slurm_site.following(overlay):
            collector = install_fake_collector(root / "collector-bin", overlay.socket)
            tools = [slurm_site.tools_dir, collector]
            monkeypatch.setenv("PATH", os.pathsep.join([*map(str, tools), os.environ["PATH"]]))
            monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
            Configuration().update_config(
                {
                    "BatchSystem": {
                        "adapter": "HTCondor",
                        "max_age": 0.05,  # minutes
                        "ratios": {"cpu_ratio": "Real(TotalSlotCpus-Cpus)/TotalSlotCpus"},
                    },
                    "Sites": [
                        {
                            "name": "Site1",
                            "adapter": "Slurm",
                            "quota": 2,
                            "drone_heartbeat_interval": 1,
                        }
                    ],
                    "Site1": tardis_site,
                }
            )
            try:
                yield slurm_site
            finally:
                slurm.run("scontrol", "update", f"PartitionName={PARTITION}", "State=UP")
                slurm.cancel_all()
    finally:
        await overlay.close()
        truth.close()
        Configuration._shared_state.clear()
        SiteAdapter.site_configuration.fget.cache_clear()


@pytest.fixture
async def site(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[SlurmSite]:
    """The site of 3-second payloads whose ads say nothing of their runtime"""
    async with _slurm_site(slurm, tmp_path, monkeypatch) as slurm_site:
        yield slurm_site


@dataclass
class SlurmDrone:
    """A real TARDIS drone on TARDIS's Slurm site adapter, wrapped by the decorators"""

    drone: Drone
    site: RemoteSiteAdapter
    states: Transitions
    bus: RemoteBus

    @classmethod
    def make(cls, bus: RemoteBus, *plugins: Any, **restored: Any) -> SlurmDrone:
        site = RemoteSiteAdapter(SlurmAdapter("m1", "Site1"), bus)
        batch = RemoteBatchSystemAdapter(HTCondorBatchAdapter(), bus)
        states = Transitions()
        drone = Drone(
            site_agent=SiteAgent(site),
            batch_system_agent=BatchSystemAgent(batch),
            plugins=[TardisStateNotes(bus), states, *plugins],
            **restored,
        )
        return cls(drone, site, states, bus)

    @property
    def uuid(self) -> str:
        return str(self.drone.resource_attributes.drone_uuid)

    @property
    def job_id(self) -> int:
        return int(self.drone.resource_attributes.remote_resource_uuid)

    def view(self) -> Any:
        return self.bus.registry.view(SITE, self.uuid)

    def running(self) -> contextlib.AbstractAsyncContextManager[asyncio.Task[None]]:
        return drone_running(self.drone)

    async def let_go_in(
        self, state: str, before: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Run it; once it reaches ``state`` (and ``before`` is done) COBalD lets it go"""
        async with self.running() as task:
            await wait_until(lambda: state in self.states.states, 90, state)
            if before is not None:
                await before()
            self.drone.demand = 0
            await asyncio.wait_for(task, 120)
        assert self.states.states[-1] == "DownState"


def _busy(drone: SlurmDrone) -> Callable[[], bool]:
    return lambda: (view := drone.view()) is not None and view.state is ev.DroneState.BUSY


def _startd_events(site: SlurmSite, job_id: int) -> list[str]:
    started = site.started(job_id)
    assert started is not None, f"job {job_id} never ran"
    truth = Path(started["sandbox"]) / "ep" / "ground_truth.jsonl"
    return [e["event"] for e in read_ground_truth(truth)]


async def test_a_drone_given_up_while_queued_is_released_and_cancelled_before_it_runs(
    site: SlurmSite, make_bus: BusFactory
) -> None:
    bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
    # nothing starts: the partition takes jobs but runs none
    site.cluster.run("scontrol", "update", f"PartitionName={PARTITION}", "State=DOWN")
    tardis = SlurmDrone.make(bus)

    async def queued() -> None:
        assert site.state(tardis.job_id) == "PENDING"

    await tardis.let_go_in("BootingState", before=queued)  # demand drops while it waits
    assert "CleanupState" in tardis.states.states
    view = tardis.view()
    assert view is not None and view.phase is ev.RecordPhase.RELEASED  # the manager won
    assert tardis.site.counts["terminate_resource_allowed"] >= 1
    assert [(c["args"], c["state"]) for c in site.calls("scancel")] == [
        (str(tardis.job_id), "PENDING")
    ]
    assert site.state(tardis.job_id) == "CANCELLED"
    site.cluster.run("scontrol", "update", f"PartitionName={PARTITION}", "State=UP")
    assert site.started(tardis.job_id) is None  # it never ran
    assert len(site.calls("sbatch")) == 1 and site.calls("squeue")  # TARDIS's own view


async def test_a_drone_with_payloads_drains_and_ends_its_own_job(
    site: SlurmSite, make_bus: BusFactory, nats_server: EmbeddedServer
) -> None:
    """TARDIS lets it go while a payload runs: the agent drains, the job exits 0, no scancel"""
    # two broker addresses for the drones: Slurm's --export list is comma-separated
    servers = f"{nats_server.url},nats://127.0.0.1:9"
    bus = await make_bus(
        lost_after_s=10.0, request_timeout_s=5.0, drain_deadline_s=60.0, drone_servers=servers
    )
    tardis = SlurmDrone.make(bus)

    async def claimed_and_busy() -> None:
        view = tardis.view()
        assert view is not None and view.phase is ev.RecordPhase.UP  # the agent claimed it
        await wait_until(_busy(tardis), 60, "a payload runs")

    await tardis.let_go_in("AvailableState", before=claimed_and_busy)
    assert tardis.site.counts["status_from_agent"] > 0
    view = tardis.view()
    assert view is not None and view.phase is ev.RecordPhase.DRAINED
    job = tardis.job_id
    assert await site.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 60) == "COMPLETED"
    assert site.cluster.job(job)["ExitCode"] == "0:0"
    ended = site.ended(job)
    assert ended is not None and ended["returncode"] == 0
    assert site.scancels_of("RUNNING") == []
    startd = _startd_events(site, job)
    assert startd.count("payload_started") >= 1
    assert startd.count("payload_finished") == startd.count("payload_started")
    assert "payload_killed" not in startd
    # what Slurm passed to the job (sbatch --export=...): TARDIS's variables with the
    # agent's settings, the job user's login environment, nothing else of the submit host
    started = site.started(job)
    assert started is not None
    env = started["env"]
    assert env["TardisDroneUuid"] == tardis.uuid
    assert env["TardisDroneCobaldRemoteSite"] == SITE
    # ... cut at the first comma: of several broker addresses the job gets the first alone
    assert env["TardisDroneCobaldRemoteUrl"] == nats_server.url
    assert env["SLURM_Walltime"] == "60"
    assert "PYTEST_CURRENT_TEST" not in env and "SLURM_CONF" in os.environ
    # the agent removed the spool directory it made, the drone's key in it, at its end
    sandbox = Path(started["sandbox"])
    assert (sandbox / "ep").is_dir() and not (sandbox / "spool").exists()


async def test_a_drone_whose_agent_never_connects_runs_as_stock_tardis_would(
    site: SlurmSite, make_bus: BusFactory
) -> None:
    """
    TARDIS's Slurm adapter does all the work: squeue, then scancel of the running job
    (ShutDown, Cleanup). The agent cannot reach the bus, so it never opens the gate and
    no payload ever runs: the removal is safe.
    """
    bus = await make_bus(
        lost_after_s=10.0, request_timeout_s=2.0, drone_servers="nats://127.0.0.1:9"
    )
    tardis = SlurmDrone.make(bus)
    await tardis.let_go_in("AvailableState")
    assert "DrainingState" in tardis.states.states
    assert tardis.site.counts["status_from_agent"] == 0
    view = tardis.view()
    assert view is not None and view.phase is ev.RecordPhase.RELEASED  # released by the drain
    job = tardis.job_id
    assert site.scancels_of("RUNNING"), site.calls()  # stock TARDIS: scancel
    assert await site.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, 60) == "CANCELLED"
    startd = _startd_events(site, job)
    assert "drain_requested" in startd  # TARDIS's condor_drain reached the startd
    assert "payload_started" not in startd  # the gate never opened


async def test_an_operators_scancel_is_told_by_the_agent_as_the_drones_end(
    site: SlurmSite, make_bus: BusFactory
) -> None:
    bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
    tardis = SlurmDrone.make(bus)
    async with tardis.running():
        await wait_until(lambda: "AvailableState" in tardis.states.states, 90, "Available")
        await wait_until(_busy(tardis), 60, "a payload runs")
        view = tardis.view()
        assert view is not None
        # the site's operator cancels the job, outside TARDIS; the agent's last event says
        # the drone exits (a silent end would make it lost instead, after lost_after_s)
        site.cluster.run("scancel", str(tardis.job_id))
        await wait_until(
            lambda: (view := tardis.view()) is not None and view.state is ev.DroneState.EXITING,
            site.agent_heartbeat_s * 10,
            "the agent's last event",
        )
        await wait_until(lambda: tardis.states.states[-1] == "DownState", 90, "TARDIS: Down")
    view = tardis.view()
    assert view is not None and view.state is ev.DroneState.EXITING
    assert site.scancels_of("RUNNING") == []  # TARDIS itself cancelled nothing
    assert await site.wait_state(tardis.job_id, {"CANCELLED"}, 60) == "CANCELLED"


def _pools(composite: Any) -> list[RemoteFactoryPool]:
    """The pools of a composite ``create_composite_pool`` built"""
    found: list[RemoteFactoryPool] = []

    def walk(node: Any) -> None:
        if isinstance(node, RemoteFactoryPool):
            found.append(node)
            return
        for child in getattr(node, "children", None) or []:
            walk(child)
        if hasattr(node, "target"):
            walk(node.target)

    walk(composite)
    return found


async def test_a_restarted_cobald_picks_its_drones_up_and_removes_none_with_payloads(
    site: SlurmSite, make_bus: BusFactory, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """TARDIS's SQLite registry restores the drone; the rebuilt registry knows its payloads"""
    Configuration().update_config(
        {"Plugins": {"SqliteRegistry": {"db_file": str(tmp_path / "drone_registry.db")}}}
    )
    settings = {"lost_after_s": 10.0, "request_timeout_s": 5.0, "drain_deadline_s": 60.0}
    registry = SqliteRegistry()
    first = SlurmDrone.make(await make_bus(**settings), registry)

    def stored() -> list[str]:
        return [str(row["state"]) for row in registry.get_resources("Site1", "m1")]

    async with first.running():
        await wait_until(lambda: "AvailableState" in first.states.states, 90, "Available")
        await wait_until(_busy(first), 60, "a payload runs")
        await wait_until(lambda: stored() == ["AvailableState"], 30, "stored as Available")
    first.bus.stop()  # the daemon ends abruptly: no state change, no removal
    job = first.job_id

    # the daemon starts again: the same factory COBalD's configuration builds
    composite = create_composite_pool(interval=1, bus={"servers": nats_server.url, **settings})
    [pool] = _pools(composite)
    [restored] = pool.children  # COBalD would run it
    assert restored.resource_attributes.drone_uuid == first.uuid
    assert str(restored.resource_attributes.remote_resource_uuid) == str(job)  # SQLite: a str
    assert str(restored.state) == "AvailableState"
    bus = pool.bus
    assert bus is not None
    bus_task = asyncio.create_task(bus.run())
    try:
        assert await bus.wait_ready(30), "the bus did not connect"
        view = bus.registry.view(SITE, first.uuid)
        assert view is not None and view.state is ev.DroneState.BUSY  # rebuilt from the stream
        second = SlurmDrone(restored, restored.site_agent._site_adapter, Transitions(), bus)
        restored.register_plugins(second.states)
        async with second.running() as task:
            restored.demand = 0  # COBalD lets it go at once
            await asyncio.wait_for(task, 120)
        assert second.states.states[-1] == "DownState"
    finally:
        bus.stop()
        await asyncio.wait_for(bus_task, 30)
    view = second.view()
    assert view is not None and view.phase is ev.RecordPhase.DRAINED
    assert await site.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 60) == "COMPLETED"
    assert site.scancels_of("RUNNING") == []
    startd = _startd_events(site, job)
    assert startd.count("payload_finished") == startd.count("payload_started") >= 1


@contextlib.contextmanager
def _min_job_age(cluster: SlurmCluster, seconds: int) -> Iterator[None]:
    """
    Slurm forgets a finished job ``seconds`` after its end for the block (``MinJobAge``)

    TARDIS 0.9.0's Slurm adapter takes a FAILED job for an error and keeps its drone in
    CleanupState until squeue no longer lists the job (``tardis/adapters/sites/slurm.py``
    maps no state to FAILED): only then is the drone down and the pool asks for another.
    """
    conf = cluster.conf.read_text()
    cluster.conf.write_text(conf.replace("MinJobAge=600", f"MinJobAge={seconds}"))
    cluster.run("scontrol", "reconfigure")
    try:
        yield
    finally:
        cluster.conf.write_text(conf)
        cluster.run("scontrol", "reconfigure")


class Adjusted:
    """
    A pool of real TARDIS drones on the Slurm site, adjusted as COBalD's ``FactoryPool.run``
    adjusts it (every ``interval``, ``_shrink`` or ``_grow``), its drones' state machines
    running; counts the drones it asked for

    :param bus: the decorators' bus (a :class:`RemoteFactoryPool`); ``None``: stock TARDIS,
        TARDIS's own ``FactoryPool`` and adapters
    """

    def __init__(self, bus: RemoteBus | None, demand: float) -> None:
        self.bus = bus
        self.drones: list[Drone] = []
        self.tasks: list[asyncio.Task[None]] = []
        pool: Any
        if bus is None:
            pool = FactoryPool(factory=self._stock, interval=0.2)
        else:
            pool = RemoteFactoryPool(factory=self._remote, interval=0.2, bus=bus, site=SITE)
        self.pool = pool
        pool.demand = demand

    def _track(self, drone: Drone) -> Drone:
        self.drones.append(drone)
        self.tasks.append(asyncio.create_task(drone.run()))
        return drone

    def _stock(self) -> Drone:
        batch = HTCondorBatchAdapter()
        return self._track(
            Drone(
                site_agent=SiteAgent(SlurmAdapter("m1", "Site1")),
                batch_system_agent=BatchSystemAgent(batch),
            )
        )

    def _remote(self) -> Drone:
        assert self.bus is not None
        return self._track(SlurmDrone.make(self.bus).drone)

    def adjust(self) -> None:
        pool = self.pool
        if pool.supply > pool.demand:
            pool._shrink(target=pool.demand)
        else:
            pool._grow(target=pool.demand)

    async def close(self) -> None:
        for drone in self.drones:
            drone.demand = 0
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_drone_jobs_that_fail_at_once_throttle_their_site_while_stock_tardis_submits(
    site: SlurmSite, make_bus: BusFactory
) -> None:
    """
    The site's drone job cannot find the agent (its drone.env names a path that is not
    there), so every job exits 127 the moment it starts: no agent ever speaks, and TARDIS
    sees each job gone. The decorated pool flags the site after three such drones and asks
    for nothing more but probes; TARDIS's own pool, beside it on the same site, keeps
    submitting. Fixed, the next probe runs a payload and the pool feeds the site again.
    """
    env = site.root / "drone.env"
    working = env.read_text()
    env.write_text(working.replace("COBALD_REMOTE=", "COBALD_REMOTE=/nonexistent/", 1))
    bus = await make_bus(
        lost_after_s=10.0,
        request_timeout_s=5.0,
        black_hole_backoff_s=20.0,
        black_hole_backoff_max_s=20.0,
    )
    remote, stock = Adjusted(bus, demand=2), Adjusted(None, demand=2)

    async def adjusting() -> None:
        while True:  # COBalD's FactoryPool.run: an adjustment every interval
            remote.adjust()
            stock.adjust()
            await asyncio.sleep(remote.pool.interval)

    adjuster = asyncio.create_task(adjusting())
    try:
        with _min_job_age(site.cluster, 2):
            await _throttled_then_fed(remote, stock, lambda: env.write_text(working))
    finally:
        adjuster.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await adjuster
        await remote.close()
        await stock.close()


async def _throttled_then_fed(remote: Adjusted, stock: Adjusted, fix: Callable[[], object]) -> None:
    """The remote site flagged, stock submitting meanwhile; fixed, a probe clears the flag"""
    assert remote.bus is not None
    detector = remote.bus.black_holes
    await wait_until(lambda: SITE in detector.flags, 180, "the site flagged")
    flagged_at = (len(remote.drones), len(stock.drones))
    assert detector.verdict(SITE, remote.drones[0].resource_attributes.drone_uuid) == "died"
    # stock TARDIS submits six more drones to the broken site meanwhile
    await wait_until(lambda: len(stock.drones) >= flagged_at[1] + 6, 180, "stock submits")
    probes = detector.probes[SITE]
    assert len(remote.drones) - flagged_at[0] == probes < 6
    assert detector.withheld[SITE] > 0
    # the site is fixed: a probe drone comes up, runs a payload, and clears the flag
    fix()
    await wait_until(lambda: SITE not in detector.flags, 180, "a probe runs a payload")
    await wait_until(
        lambda: sum(d.demand for d in remote.drones) >= 2, 60, "the pool feeds the site"
    )
    # the probe that ran it may have been asked for before the fix: its job reads drone.env
    # when Slurm starts it
    assert detector.probes[SITE] >= max(probes, 1)


# --------------------------------------------------------------------------- the drone's end

_OVER = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def _planned_end(cluster: SlurmCluster, job: int) -> float:
    """The epoch second Slurm ends ``job`` at: its start plus its time limit"""
    result = subprocess.run(
        [cluster.programs["scontrol"], "show", "job", "-o", str(job)],
        env={**cluster.env(), "SLURM_TIME_FORMAT": "%s"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    fields = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
    limit = parse_slurm_time(fields["TimeLimit"])
    assert limit is not None
    return float(fields["StartTime"]) + limit


async def _drone_events(js: JetStreamContext, drone: SlurmDrone) -> list[ev.AnyEvent]:
    return [event for _, event in await read_events(js, drone.uuid)]


def _vacated(events: list[ev.AnyEvent]) -> list[ev.PayloadFinished]:
    return [e for e in events if isinstance(e, ev.PayloadFinished) and e.vacated]


async def test_a_drone_ends_itself_before_its_time_limit_and_starts_nothing_that_would_not_fit(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_bus: BusFactory
) -> None:
    """
    A one-minute drone and 8-second payloads whose ads say so: the agent learns its job's
    end from squeue, lets in only payloads that end before it, drains itself, and its job
    completes before Slurm's limit; no payload is killed or vacated
    """
    async with _slurm_site(
        slurm, tmp_path, monkeypatch, payload_s=8.0, runtime_in_ad=True, walltime_min=1
    ) as site:
        bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
        tardis = SlurmDrone.make(bus)
        async with tardis.running():
            await wait_until(lambda: "BootingState" in tardis.states.states, 90, "submitted")
            job = tardis.job_id
            await wait_until(_busy(tardis), 90, "a payload runs")
            end = _planned_end(site.cluster, job)
            assert await site.wait_state(job, _OVER, 180) == "COMPLETED"
        view = tardis.view()
    assert site.cluster.job(job)["ExitCode"] == "0:0"
    assert site.scancels_of("RUNNING") == []
    truth = read_ground_truth(Path(_sandbox(site, job)) / "ep" / "ground_truth.jsonl")
    started = [e for e in truth if e["event"] == "payload_started"]
    assert started and len(started) == sum(e["event"] == "payload_finished" for e in truth)
    assert not [e for e in truth if e["event"] == "payload_killed"]
    # each payload the gate let in ended, by its ad, before the job's end ...
    assert all(e["t"] + e["duration_s"] <= end for e in started), (end, started)
    # ... and each it refused for the end would not have
    for refused in (e for e in truth if e.get("hook_status_code") == END_REFUSED_STATUS):
        assert refused["t"] + 8.0 > end - site.end_margin_s, (end, refused)
    assert view is not None and view.event is not None
    last = view.event.snapshot.end
    assert last is not None and last.source == "squeue" and last.notice == ""


def _sandbox(site: SlurmSite, job: int) -> str:
    started = site.started(job)
    assert started is not None, f"job {job} never ran"
    return str(started["sandbox"])


async def test_a_term_signal_vacates_what_cannot_finish_in_its_grace_and_ends_the_job(
    slurm: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_bus: BusFactory,
    js: JetStreamContext,
) -> None:
    """
    SIGTERM to every process of the job, as a cancel or a preemption sends it, without the
    SIGKILL that follows (``scancel --signal=TERM`` alone signals a job's steps, and a drone
    has none): the agent takes it for the end in ``KillWait``, vacates the payload that
    would outlive it, and its job completes
    """
    async with _slurm_site(
        slurm, tmp_path, monkeypatch, payload_s=60.0, runtime_in_ad=True
    ) as site:
        bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
        tardis = SlurmDrone.make(bus)
        async with tardis.running():
            await wait_until(lambda: "AvailableState" in tardis.states.states, 90, "Available")
            await wait_until(_busy(tardis), 60, "a payload runs")
            job = tardis.job_id
            site.cluster.run("scancel", "--signal=TERM", "--full", str(job))
            assert await site.wait_state(job, _OVER, 90) == "COMPLETED"
            await wait_until(lambda: tardis.states.states[-1] == "DownState", 90, "TARDIS: Down")
    assert site.cluster.job(job)["ExitCode"] == "0:0"
    assert site.scancels_of("RUNNING") == []
    truth = read_ground_truth(Path(_sandbox(site, job)) / "ep" / "ground_truth.jsonl")
    killed = [(e["reason"]) for e in truth if e["event"] == "payload_killed"]
    assert killed == ["drain_fast"]  # the startd evicted it: the overlay pool queues it again
    assert [e["reason"] for e in truth if e["event"] == "job_exit"] == ["evict"]
    assert truth[-1]["event"] == "master_exiting"
    events = await _drone_events(js, tardis)
    assert [e.how for e in _vacated(events)] == [ev.PayloadEnd.EVICT]
    notices = {e.snapshot.end.notice for e in events if e.snapshot.end is not None}
    assert "SIGTERM" in notices


async def test_a_warning_signal_sent_ahead_vacates_and_the_job_completes(
    slurm: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_bus: BusFactory,
    js: JetStreamContext,
) -> None:
    """
    ``sbatch --signal=B:USR1@100`` (TARDIS's SubmitOptions), to the batch script alone: the
    site says the signal leaves its drones 6 seconds, so the agent vacates its payload and
    the job completes long before its time limit
    """
    async with _slurm_site(
        slurm,
        tmp_path,
        monkeypatch,
        payload_s=100.0,
        runtime_in_ad=True,
        walltime_min=2,
        signal="B:USR1@100",
        warning_grace_s=6.0,
    ) as site:
        bus = await make_bus(lost_after_s=10.0, request_timeout_s=5.0)
        tardis = SlurmDrone.make(bus)
        async with tardis.running():
            await wait_until(lambda: "BootingState" in tardis.states.states, 90, "submitted")
            job = tardis.job_id
            await wait_until(_busy(tardis), 90, "a payload runs")
            assert await site.wait_state(job, _OVER, 180) == "COMPLETED"
    assert any("--signal=B:USR1@100" in call["args"] for call in site.calls("sbatch"))
    assert site.cluster.job(job)["ExitCode"] == "0:0"
    truth = read_ground_truth(Path(_sandbox(site, job)) / "ep" / "ground_truth.jsonl")
    assert [e["reason"] for e in truth if e["event"] == "payload_killed"] == ["drain_fast"]
    events = await _drone_events(js, tardis)
    assert [e.how for e in _vacated(events)] == [ev.PayloadEnd.EVICT]
    ends = [e.snapshot.end for e in events if e.snapshot.end is not None]
    assert ends[0].source == "squeue" and ends[-1].notice == "SIGUSR1"
