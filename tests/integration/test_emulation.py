"""
The emulated execution point with the shipped deploy/htcondor configuration:
offers go through START and the real PREPARE_JOB / JOB_EXIT hooks to a gate
served here (by a plain fake agent); drains and signals end it as HTCondor would
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.gate import FakeAgent, GateFactory

from broker.emulation.execution_point import EmulatedMaster, EmulatorControl, install_fake_condor
from broker.emulation.site.overlay import OverlayPool
from remote_agent.htcondor import CondorStartd
from remote_agent.interfaces import AGENT_UNREACHABLE_STATUS, GATE_CLOSED_STATUS, JobStart
from remote_agent.protocol.events import PayloadEnd

TERMINAL = {"payload_finished", "payload_killed", "payload_refused", "payload_held"}

Install = Callable[..., dict[str, str]]


@pytest.fixture
async def agent(start_gate: GateFactory) -> tuple[FakeAgent, dict[str, str]]:
    """A fake agent serving the gate; its worker environment"""
    server, fake = await start_gate()
    return fake, server.environment()


@pytest.fixture
def install(tmp_path: Path) -> Install:
    def make(**kwargs: Any) -> dict[str, str]:
        return install_fake_condor(tmp_path / "bin", tmp_path / "ep", **kwargs)

    return make


def events(ep: EmulatorControl, *names: str) -> list[dict[str, Any]]:
    return [e for e in ep.ground_truth() if not names or e["event"] in names]


def assert_one_end_per_job(ep: EmulatorControl) -> None:
    claimed = [e["job_id"] for e in events(ep, "claimed")]
    ends = [e["job_id"] for e in events(ep, *TERMINAL, "payload_vacated")]
    assert sorted(claimed) == sorted(ends), (claimed, ends)
    times = [e["t"] for e in ep.ground_truth()]
    assert times == sorted(times)


async def test_a_payload_runs_when_the_agent_allows(
    install: Install, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    env = {**install(slots=1), **worker_env}
    async with EmulatedMaster(env) as ep:
        await CondorStartd(env=env).set_accepting(True)
        reply = await ep.offer("31.4", 0.5, exit_code=3, owner="alice")
        assert reply["outcome"] == "started"
        await ep.wait_for("job_exit", job_id="31.4")
        assert fake.started == [JobStart(job_id="31.4", slot="slot1@drone.emulated", owner="alice")]
        [(job_id, how, code, duration)] = fake.exited
        assert (job_id, how, code) == ("31.4", PayloadEnd.EXIT, 3)
        # the startd's own measure of the payload's runtime, carried by the hook unchanged
        [finished] = events(ep, "payload_finished")
        assert duration == finished["runtime_s"]
        order = [e["event"] for e in events(ep) if e.get("job_id") == "31.4"]
        assert order == [
            "claimed",
            "prepare_job",
            "payload_started",
            "payload_finished",
            "job_exit",
        ]
        [prepare] = events(ep, "prepare_job")
        assert (prepare["decision"], prepare["exit_status"]) == ("run", 0)
        assert (await ep.status())["slots"][0]["state"] == "Unclaimed"
        assert_one_end_per_job(ep)


async def test_a_refusal_sends_the_job_back_to_idle(
    install: Install, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    fake.open = False
    env = {**install(slots=1), **worker_env}
    async with EmulatedMaster(env) as ep:
        await CondorStartd(env=env).set_accepting(True)
        reply = await ep.offer("2.0", 30)
        assert (reply["outcome"], reply["status"]) == ("idle", GATE_CLOSED_STATUS)
        [prepare] = events(ep, "prepare_job")
        assert (prepare["hook_status_code"], prepare["decision"]) == (GATE_CLOSED_STATUS, "idle")
        assert not events(ep, "payload_started", "payload_held")
        assert (await ep.status())["slots"][0]["state"] == "Unclaimed"
        assert fake.exited == []
        assert_one_end_per_job(ep)


async def test_without_an_agent_jobs_go_back_to_idle_never_on_hold(install: Install) -> None:
    env = install(slots=1)
    async with EmulatedMaster(env) as ep:
        await CondorStartd(env=env).set_accepting(True)
        reply = await ep.offer("3.0", 30)
        assert (reply["outcome"], reply["status"]) == ("idle", AGENT_UNREACHABLE_STATUS)
        assert not events(ep, "payload_held", "payload_started")


async def test_a_closed_start_gate_claims_nothing(
    install: Install, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    env = {**install(slots=2), **worker_env}
    async with EmulatedMaster(env) as ep:
        assert (await ep.offer("4.0", 30))["reason"] == "START is false"
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        await startd.set_accepting(False)
        assert (await ep.offer("4.1", 30))["reason"] == "START is false"
        assert fake.started == []  # the hook never ran: nothing was claimed
        assert not events(ep, "claimed", "prepare_job")


@pytest.mark.parametrize(
    ("script", "outcome", "detail"),
    [
        ("exit 0\n", "started", {}),
        ("echo 'HookStatusCode = 0'\nexit 0\n", "started", {}),
        ("exit 1\n", "held", {"hold_subcode": 1, "hold_reason_code": 19}),
        ("echo 'HookStatusCode = 190'\nexit 0\n", "held", {"hold_subcode": 190}),
        ("echo 'HookStatusCode = 350'\nexit 7\n", "idle", {"status": 350}),
        ('echo \'HookStatusMessage = "full"\'\necho "HookStatusCode = 399"\n', "idle", {}),
        ("kill -9 $$\n", "idle", {"status": -9}),
    ],
    ids=["exit0", "code0", "exit1", "code190", "code350", "code399", "signal"],
)
async def test_prepare_job_results_as_the_starter_treats_them(
    tmp_path: Path, install: Install, script: str, outcome: str, detail: dict[str, int]
) -> None:
    hook = tmp_path / "prepare"
    hook.write_text("#!/bin/sh\ncat >/dev/null\n" + script)
    hook.chmod(0o755)
    env = install(slots=1, extra_config={"COBALD_REMOTE_HOOK_PREPARE_JOB": str(hook)})
    async with EmulatedMaster(env) as ep:
        await CondorStartd(env=env).set_accepting(True)
        reply = await ep.offer("5.0", 0.1)
        assert reply["outcome"] == outcome
        assert detail.items() <= reply.items()


async def test_a_graceful_drain_lets_payloads_finish_then_the_master_exits(
    install: Install, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    env = {**install(slots=2), **worker_env}
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        for job in ("6.0", "6.1"):
            assert (await ep.offer(job, 1.5))["outcome"] == "started"
        await startd.set_accepting(False)
        assert (await startd.drain("tardis: demand dropped")).accepted
        assert (await ep.offer("6.2", 1))["outcome"] == "rejected"
        assert await master.wait() == 99
        assert {e["job_id"] for e in events(ep, "payload_finished")} == {"6.0", "6.1"}
        assert not events(ep, "payload_killed")
        assert sorted((j, h) for j, h, _, _ in fake.exited) == [
            ("6.0", PayloadEnd.EXIT),
            ("6.1", PayloadEnd.EXIT),
        ]
        names = [e["event"] for e in events(ep)]
        assert names.index("drain_completed") > max(
            i for i, name in enumerate(names) if name == "job_exit"
        )
        assert names[-2:] == ["startd_exited", "master_exiting"]
        assert_one_end_per_job(ep)


async def test_a_fast_drain_kills_and_the_agent_hears_evict(
    install: Install, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    env = {**install(slots=1), **worker_env}
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        assert (await ep.offer("7.0", 600))["outcome"] == "started"
        assert (await startd.drain("deadline", fast=True)).accepted
        assert await master.wait() == 99
        [killed] = events(ep, "payload_killed")
        assert (killed["job_id"], killed["reason"]) == ("7.0", "drain_fast")
        assert fake.exited[0][:3] == ("7.0", PayloadEnd.EVICT, -9)
        assert_one_end_per_job(ep)


async def test_a_drain_during_prepare_job_lets_the_allowed_payload_finish(
    tmp_path: Path, install: Install
) -> None:
    release = tmp_path / "release"
    hook = tmp_path / "slow-prepare"
    # a slow decision: allow once the test says so
    hook.write_text(f"#!/bin/sh\ncat >/dev/null\nwhile [ ! -e {release} ]; do sleep 0.05; done\n")
    hook.chmod(0o755)
    env = install(slots=1, extra_config={"COBALD_REMOTE_HOOK_PREPARE_JOB": str(hook)})
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        offer = asyncio.create_task(ep.offer("8.0", 0.5))
        await ep.wait_for("claimed", job_id="8.0")
        assert (await startd.drain("while preparing")).accepted
        release.touch()
        assert (await offer)["outcome"] == "started"
        assert await master.wait() == 99
        names = [e["event"] for e in events(ep)]
        assert names.index("drain_requested") < names.index("payload_started")
        assert names.index("payload_finished") < names.index("drain_completed")
        assert not events(ep, "payload_killed")


async def test_a_fast_drain_during_prepare_job_vacates_the_claim(
    tmp_path: Path, install: Install
) -> None:
    hook = tmp_path / "hanging-prepare"
    hook.write_text("#!/bin/sh\ncat >/dev/null\nexec sleep 300\n")
    hook.chmod(0o755)
    env = install(slots=1, extra_config={"COBALD_REMOTE_HOOK_PREPARE_JOB": str(hook)})
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        offer = asyncio.create_task(ep.offer("9.0", 30))
        await ep.wait_for("claimed", job_id="9.0")
        assert (await startd.drain("now", fast=True)).accepted
        assert (await offer)["outcome"] == "vacated"
        assert await master.wait() == 99
        assert not events(ep, "payload_started")
        assert_one_end_per_job(ep)


@pytest.mark.parametrize(
    ("sig", "reason"),
    [(signal.SIGTERM, "shutdown_graceful_timeout"), (signal.SIGQUIT, "shutdown_fast")],
)
async def test_signals_shut_down_the_master(
    install: Install,
    agent: tuple[FakeAgent, dict[str, str]],
    sig: signal.Signals,
    reason: str,
) -> None:
    fake, worker_env = agent
    env = {**install(slots=1, extra_config={"SHUTDOWN_GRACEFUL_TIMEOUT": "1"}), **worker_env}
    master = EmulatedMaster(env)
    async with master as ep:
        await CondorStartd(env=env).set_accepting(True)
        assert (await ep.offer("10.0", 600))["outcome"] == "started"
        master.signal(sig)
        assert await master.wait() == 0
        [killed] = events(ep, "payload_killed")
        assert killed["reason"] == reason
        if sig == signal.SIGTERM:
            assert killed["runtime_s"] >= 0.99  # retired up to SHUTDOWN_GRACEFUL_TIMEOUT
        assert [(j, h) for j, h, _, _ in fake.exited] == [("10.0", PayloadEnd.EVICT)]
        assert_one_end_per_job(ep)


async def test_partitionable_slots_run_one_job_per_cpu(
    install: Install, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    env = {**install(slots=2, partitionable=True), **worker_env}
    async with EmulatedMaster(env) as ep:
        await CondorStartd(env=env).set_accepting(True)
        replies = await asyncio.gather(*(ep.offer(f"11.{n}", 60) for n in range(3)))
        outcomes = sorted(r["outcome"] for r in replies)
        assert outcomes == ["rejected", "started", "started"]
        assert sorted(job.slot for job in fake.started) == [
            "slot1_1@drone.emulated",
            "slot1_2@drone.emulated",
        ]


def condor(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


async def test_condor_drain_as_the_real_tool(install: Install) -> None:
    env = install(slots=1, extra_config=["STARTER_JOB_HOOK_KEYWORD ="])
    async with EmulatedMaster(env) as ep:
        status = await ep.status()
        address, name = status["startd_address"], status["startd_name"]
        await CondorStartd(env=env).set_accepting(True)
        assert (await ep.offer("12.0", 600))["outcome"] == "started"
        check = 'State =!= "Claimed"'
        done = await asyncio.to_thread(
            condor, env, "condor_drain", "-check", check, "-exit-on-completion", address
        )
        assert done.returncode == 1
        assert done.stderr.splitlines() == [
            f"Attempt to send DRAIN_JOBS to startd {address} failed",
            f"Received failure from {name} in response to DRAIN_JOBS request: error code 10003:"
            f" Draining check expression is false on slot1@{name}.",
        ]
        assert (await ep.status())["draining"] is None  # refused: nothing changed
        done = await asyncio.to_thread(
            condor, env, "condor_drain", "-cancel", "-request-id", "7", name
        )
        assert done.returncode == 1 and "error code 10002" in done.stderr
        for argv, code in [
            (("-graceful",), 2),  # no target
            (("-bogus", name), 2),
            (("-request-id", "1", name), 2),
            (("-cancel", "-reason", "x", name), 2),
            (("-reason",), 1),  # requires another argument
            (("-resume-on-completion", "-exit-on-completion", name), 1),
            (("-help",), 1),
            (("-graceful", "no-such-startd.example.org"), 1),
        ]:
            done = await asyncio.to_thread(condor, env, "condor_drain", *argv)
            assert done.returncode == code, (argv, done.stderr)
        done = await asyncio.to_thread(
            condor, env, "condor_drain", "-verbose", "-quick", "-reason", "by hand", name
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"Sent request to drain the startd {address} with {name}.")
        assert "\tRequest id: 1" in done.stdout
        killed = await ep.wait_for("payload_killed", job_id="12.0")
        assert killed["reason"] == "drain_quick"
        # without -exit-on-completion the startd stays, drained, and can be resumed
        assert (await ep.status())["slots"][0]["state"] == "Drained"
        done = await asyncio.to_thread(condor, env, "condor_drain", "-cancel", name)
        assert (done.returncode, done.stdout) == (0, f"Sent request to cancel draining on {name}\n")
        assert (await ep.status())["slots"][0]["state"] == "Unclaimed"


async def test_condor_update_machine_ad_as_the_real_tool(install: Install) -> None:
    env = install(slots=1)
    async with EmulatedMaster(env) as ep:
        done = await asyncio.to_thread(
            subprocess.run,
            ["condor_update_machine_ad"],
            input="DroneGateOpen = True\n",
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1
        assert "Please add a blank line" in done.stderr
        assert (await ep.status())["extras"] == {}
        done = await asyncio.to_thread(
            subprocess.run,
            ["condor_update_machine_ad"],
            input="DroneGateOpen = True\nOther = 1 +\n\n",
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (done.returncode, done.stderr.splitlines()[-1]) == (1, "Syntax error in file.")
        assert (await ep.status())["extras"] == {}


async def test_the_overlay_pool_places_jobs_where_the_gate_is_open(
    tmp_path: Path, agent: tuple[FakeAgent, dict[str, str]]
) -> None:
    fake, worker_env = agent
    envs = [
        {**install_fake_condor(tmp_path / f"bin{n}", tmp_path / f"ep{n}", slots=1), **worker_env}
        for n in range(2)
    ]
    async with EmulatedMaster(envs[0]) as open_ep, EmulatedMaster(envs[1]) as closed_ep:
        await CondorStartd(env=envs[0]).set_accepting(True)  # the other drone's gate stays shut
        pool = OverlayPool(tmp_path / "obs", None, None)
        pool.join("open", open_ep.state_dir)
        pool.join("closed", closed_ep.state_dir)
        for n in range(3):
            pool.submit(f"20.{n}", 0.2)
        async with asyncio.timeout(60):
            while pool.job_states()["done"] < 3:
                await pool.negotiate()
                await asyncio.sleep(0.1)
        assert {job.starts for job in pool.jobs.values()} == {1}
        assert len(events(open_ep, "payload_finished")) == 3
        assert not events(closed_ep, "claimed")
        assert len(fake.started) == 3
