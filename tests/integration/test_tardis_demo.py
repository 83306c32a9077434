"""
The report's race end to end: real COBalD daemon, real TARDIS, a real nats-server, real
agent processes, emulated site and drones. Under strongly swinging demand stock TARDIS
kills running payloads; with the decorators, the same seeded scenario kills none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext
from support.processes import CLI, run_process
from support.slurm import requires_slurm
from support.waiting import wait_until

from broker.cli import build_parser
from broker.emulation.demo.command import demo
from broker.emulation.demo.run import run_mode
from broker.emulation.demo.scenario import Scenario
from broker.emulation.groundtruth import read_ground_truth
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision

pytestmark = pytest.mark.timeout(420)

#: established drones first (the pool can only shrink while it has supply), then a
#: spike whose drones start while TARDIS's cached views (30 s) still show them queued,
#: then a trough: COBalD releases the booting drones first (tardis#172)
SCENARIO = Scenario(
    demand="scripted",
    seed=3,
    duration_s=52.0,
    cooldown_s=20.0,
    max_drones=5,
    first_base_s=36.0,
    spike_s=(7.0, 7.0),
    trough_s=(7.0, 7.0),
    site_max_age_s=30.0,
    batch_max_age_s=30.0,
    queue_delay_s=(1.0, 4.0),
)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _pids(root: Path) -> list[int]:
    """Every drone job and emulated master this run started"""
    pids = []
    for entry in read_ground_truth(root / "lbs.jsonl"):
        if entry["event"] == "job_started":
            pids.append(entry["pid"])
            truth = Path(entry["sandbox"]) / "ep" / "ground_truth.jsonl"
            pids += [e["pid"] for e in read_ground_truth(truth) if e["event"] == "master_started"]
    return pids


async def _timeline(url: str, drone: str) -> list[dict[str, Any]]:
    code, out, err = await run_process(*CLI, "timeline", drone, "--server", url, "--json")
    assert code == 0, err
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


async def test_stock_tardis_kills_payloads_and_the_decorators_kill_none(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    lines: list[str] = []
    stock = await run_mode(SCENARIO, "stock", tmp_path / "stock", progress=lines.append)
    remote = await run_mode(
        SCENARIO, "remote", tmp_path / "remote", nats_url=nats_server.url, progress=lines.append
    )
    report = json.dumps({"stock": stock, "remote": remote}, indent=1)

    # the same scenario ran: as many drones asked for, busy drones in both
    assert stock["drones"]["requested"] >= 5, report
    assert remote["drones"]["requested"] >= 5, report
    assert remote["payloads"]["started"] >= 10, report
    # stock TARDIS removed drones that ran payloads, as in the report
    assert stock["payloads"]["killed"] >= 1, report
    assert stock["drones"]["removed by the site with payloads running"] >= 1, report
    # with cobald-remote not one payload died, and TARDIS saw drones up within seconds
    assert remote["payloads"]["killed"] == 0, report
    assert remote["drones"].get("removed by the site with payloads running", 0) == 0, report
    # TARDIS sees a drone running once its startd can take work: one COBalD let go before
    # that was released and removed with nothing on it
    never_running = remote["tardis_latency"]["never_seen_running"]
    assert never_running <= remote["drones"].get("removed by the site while idle", 0), report
    assert remote["tardis_latency"]["median_s"] < stock["tardis_latency"]["median_s"], report
    assert any("payloads" in line and "killed" in line for line in lines)  # progress shown

    # every process of both runs was stopped (a killed orphan may be a zombie for a moment,
    # until init reaps it)
    pids = _pids(tmp_path / "stock") + _pids(tmp_path / "remote")
    await wait_until(lambda: not [p for p in pids if _running(p)], 30, "all processes stopped")

    # the operator's timeline of a drone: its agent's events beside TARDIS's states, from
    # Request to Down (drones still shutting down when the run ended don't qualify)
    started = [
        e["drone"]
        for e in read_ground_truth(tmp_path / "remote" / "lbs.jsonl")
        if e["event"] == "job_started"
    ]
    for drone in started:
        rows = await _timeline(nats_server.url, drone)
        events = [row["drone_event"] for row in rows if row["source"] == "agent"]
        states = [row["tardis_state"] for row in rows if row["source"] == "tardis"]
        if states and states[-1].startswith("-> DownState") and "payload_started" in str(events):
            break
    else:
        pytest.fail(f"no drone of {started} has a timeline from Request to Down with payloads")
    assert events[0].startswith("agent_started") and "payload_started" in " ".join(events)
    assert states[0] == "-> RequestState (Booting)" and states[-1].startswith("-> DownState")
    # rows in stream order; each writer's own rows in its own time order (a TARDIS note
    # may be stored after a later agent event: the manager publishes notes from a queue)
    stored = [r["stream_seq"] for r in rows if r["source"] != "manager"]
    assert stored == sorted(stored)
    # the drone's end (the manager's row, not in the stream) comes last
    ends = [r for r in rows if r["source"] == "manager"]
    assert ends == rows[-1:] and ends[0]["drone_event"].startswith("ended: "), rows[-3:]
    for source in ("agent", "tardis"):
        times = [r["at"] for r in rows if r["source"] == source]
        assert times == sorted(times), source


async def test_run_main_is_the_comparison_unless_told_otherwise() -> None:
    """README: ``./run main`` is the demonstration, stock TARDIS against cobald-remote"""
    parser = build_parser()
    assert parser.parse_args(["demo"]).compare is True
    assert parser.parse_args(["demo", "--compare"]).compare is True  # as the docs write it
    assert parser.parse_args(["demo", "--no-compare"]).compare is False
    run = Path(__file__).parents[2] / "run"
    code, out, err = await run_process(str(run), "main", "--help", timeout_s=280)
    assert code == 0, err
    assert out.startswith("usage: cobald-remote demo")
    assert "--compare, --no-compare" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "adapters", ["emulated", "htcondor", pytest.param("slurm", marks=requires_slurm)]
)
async def test_the_demo_command_runs_and_writes_its_table(tmp_path: Path, adapters: str) -> None:
    """``cobald-remote demo`` (README's main job) as a user runs it, kept short"""
    report = tmp_path / "demo.json"
    code, out, err = await run_process(
        *CLI,
        "demo",
        "--no-compare",  # the run with cobald-remote alone
        "--seed",
        "2",
        "--duration",
        "10",
        "--drones",
        "2",
        "--json",
        str(report),
        "--workdir",
        str(tmp_path / "work"),
        "--tardis-adapters",
        adapters,
        timeout_s=280,
    )
    assert code == 0, err[-2000:]
    assert "with cobald-remote" in out and "payloads: killed" in out
    assert "cobald-remote demo: seed 2" in err  # progress on stderr
    document = json.loads(report.read_text())
    assert set(document["runs"]) == {"remote"}
    assert document["runs"]["remote"]["kill_reasons"] == {}
    assert not [pid for pid in _pids(tmp_path / "work" / "remote") if _running(pid)]
    assert document["scenario"]["tardis_adapters"] == adapters
    # by default every drone runs on an identity it bootstrapped from its one-time token
    logs = [
        path.read_text(errors="replace")
        for path in (tmp_path / "work" / "remote").rglob("*")
        if path.name == "job.log" or (path.name.startswith("slurm-") and path.suffix == ".out")
    ]
    started = [log for log in logs if "agent_started" in log or "gate_opened" in log]
    assert started and all("got this drone's identity" in log for log in started)
    submitted = [
        entry
        for entry in read_ground_truth(tmp_path / "work" / "remote" / "lbs.jsonl")
        if entry["event"] == "job_submitted"
    ]
    assert submitted
    # only TARDIS's own HTCondor site adapter submits through (fake) condor_submit, which
    # passes on the JDL's executable
    via_condor_submit = {entry.get("executable") for entry in submitted}
    if adapters == "htcondor":
        assert via_condor_submit == {"/usr/libexec/cobald-remote/drone-job"}
    else:
        assert via_condor_submit == {None}
    if adapters == "slurm":  # TARDIS's Slurm adapter against a real Slurm: no running job cancelled
        assert "Slurm: scancel of a running job" in out
        assert document["runs"]["remote"]["slurm"]["scancel of a running job"] == 0


@pytest.mark.timeout(420)
@pytest.mark.parametrize("adapters", ["emulated", "htcondor"])
async def test_the_controller_demand_runs_and_its_accounting_closes(
    tmp_path: Path, adapters: str
) -> None:
    """
    ``demo --compare --demand controller``, kept short: COBalD's own LinearController sets
    the demand, payloads arrive, and every payload submitted is accounted for in both runs
    """
    report = tmp_path / "demo.json"
    code, out, err = await run_process(
        *CLI,
        "demo",
        "--compare",
        "--demand",
        "controller",
        "--seed",
        "2",
        "--duration",
        "12",
        "--drones",
        "2",
        "--json",
        str(report),
        "--workdir",
        str(tmp_path / "work"),
        "--tardis-adapters",
        adapters,
        timeout_s=400,
    )
    assert code == 0, err[-2000:]
    assert "COBalD's LinearController" in err
    for row in (
        "queue: payloads queued at the end",
        "queue: wait from submit to start (s, median/p90/mean)",
        "controller: demand-lowering steps while payloads were queued",
        "controller: releases followed by a demand rise within 300 intervals (10 s)",
        "controller: releases of booting drones while payloads were queued",
    ):
        assert row in out
    document = json.loads(report.read_text())
    arrivals = document["scenario"]["arrivals"]
    assert arrivals and document["scenario"]["demand"] == "controller"
    for mode in ("stock", "remote"):
        run = document["runs"][mode]
        queue, payloads, controller = run["queue"], run["payloads"], run["controller"]
        # both runs got the same payloads: every arrival was submitted before the end
        assert queue["submitted"] == len(arrivals), mode
        # the accounting closes: each payload submitted finished, was killed, runs or waits
        assert queue["submitted"] == (
            payloads["finished"]
            + payloads["killed"]
            + payloads["running at the end"]
            + queue["queued at the end"]
        ), run
        assert 0 <= queue["wait_s"]["median"] <= queue["wait_s"]["p90"], run
        assert queue["wait_s"]["mean"] >= 0, run
        # COBalD's controller set the demand (the Limiter's minimum: 1 core), the pool
        # acted on it, and what it released is no more than it created
        assert controller["demand (cores, max)"] >= 1, run
        assert run["drones"]["requested"] >= 1, run
        assert 0 <= controller["drones released by the pool"] <= run["drones"]["requested"], run
        assert (
            controller["demand-lowering steps while payloads were queued"]
            <= controller["demand-lowering steps"]
        ), run
        released = controller["drones released by the pool"]
        assert 0 <= controller["releases of booting drones while payloads were queued"] <= released
    assert not [
        pid
        for mode in ("stock", "remote")
        for pid in _pids(tmp_path / "work" / mode)
        if _running(pid)
    ]


#: two drones wanted throughout, each with a walltime of a minute (Slurm's least), payloads
#: without end: a stock drone still runs payloads when Slurm ends its job, up to 30 s after
#: its walltime (``slurmctld`` checks time limits every 30 s), before the demand falls
WALLTIME_SCENARIO = Scenario(
    seed=1,
    duration_s=110.0,
    cooldown_s=10.0,
    max_drones=2,
    first_base_s=110.0,
    tardis_adapters="slurm",
    walltime_s=60.0,
)


@requires_slurm
@pytest.mark.timeout(600)
async def test_with_walltimes_stock_tardis_loses_payloads_at_the_end_and_cobald_remote_none(
    tmp_path: Path,
) -> None:
    """
    ``demo --compare --tardis-adapters slurm --walltime 60``, kept as short as a walltime of
    a minute allows: Slurm ends stock drones at their TIMEOUT with payloads running, the
    drones with cobald-remote end themselves before it and lose none
    """
    assert WALLTIME_SCENARIO.schedule() == [(0.0, 4.0), (110.0, 0.0)]
    results = await demo(WALLTIME_SCENARIO, ["stock", "remote"], tmp_path, progress=lambda _: None)
    stock, remote = results["stock"], results["remote"]
    killed_at_end = "killed at the drone's end"
    assert stock["payloads"][killed_at_end] > 0, stock
    assert stock["kill_reasons"]["the drone's end (walltime: Slurm's TIMEOUT)"] > 0, stock
    assert remote["payloads"][killed_at_end] == 0, remote
    assert remote["payloads"]["killed"] == 0, remote
    assert remote["kill_reasons"] == {}, remote
    assert remote["payloads"]["finished"] > 0, remote
    # the drones with cobald-remote ended themselves: none was cancelled, none timed out
    states = json.loads((tmp_path / "remote" / "slurm_states.json").read_text())
    assert "TIMEOUT" in json.loads((tmp_path / "stock" / "slurm_states.json").read_text()).values()
    assert "TIMEOUT" not in states.values(), states
    assert remote["slurm"]["scancel of a running job"] == 0, remote
    assert remote["drones"]["ended by itself (drained)"] >= 2, remote
