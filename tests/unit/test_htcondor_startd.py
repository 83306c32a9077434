"""
CondorStartd against the fake condor_* executables of an emulated execution point

The emulated startd runs the shipped deploy/htcondor configuration with the job
hooks switched off (the gate and the hooks are tested in tests/integration/).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.processes import pid_exists

from broker.emulation.execution_point import EmulatedMaster, EmulatorControl, install_fake_condor
from remote_agent.errors import StartdError
from remote_agent.htcondor import GATE_ATTRIBUTE, CondorStartd
from remote_agent.interfaces import SlotInfo

NO_HOOKS = ["STARTER_JOB_HOOK_KEYWORD ="]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return install_fake_condor(tmp_path / "bin", tmp_path / "ep", slots=2, extra_config=NO_HOOKS)


def _fake_tool(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


async def test_without_a_master_nothing_answers(env: dict[str, str]) -> None:
    startd = CondorStartd(env=env)
    assert not await startd.ready()
    assert await startd.slots() == []  # condor_who finds no startd and prints nothing
    with pytest.raises(StartdError, match="Unable to locate startd"):
        await startd.set_accepting(True)
    result = await startd.drain("nobody home")
    assert not result.accepted
    assert "not running" in result.detail


async def test_the_gate_attribute_opens_and_closes_start(env: dict[str, str]) -> None:
    async with EmulatedMaster(env) as ep:
        startd = CondorStartd(env=env)
        assert await startd.ready()
        assert await startd.slots() == []
        # the gate is closed until the agent opens it
        assert (await ep.offer("1.0", 30))["reason"] == "START is false"
        await startd.set_accepting(True)
        assert (await ep.status())["extras"] == {GATE_ATTRIBUTE: "True"}
        assert (await ep.offer("1.0", 30))["outcome"] == "started"
        assert await startd.slots() == [
            SlotInfo(name="slot1@drone.emulated", state="Claimed", activity="Busy", job_id="1.0")
        ]
        await startd.set_accepting(False)
        assert (await ep.offer("2.0", 30))["reason"] == "START is false"
        truth = [e["event"] for e in ep.ground_truth()]
        assert truth.count("payload_started") == 1


async def test_slots_of_a_partitionable_startd(tmp_path: Path) -> None:
    env = install_fake_condor(
        tmp_path / "bin", tmp_path / "ep", slots=3, partitionable=True, extra_config=NO_HOOKS
    )
    async with EmulatedMaster(env) as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        for job in ("7.0", "7.1", "7.2"):
            assert (await ep.offer(job, 60))["outcome"] == "started"
        assert (await ep.offer("7.3", 60))["reason"] == "no free slot"
        slots = await startd.slots()
        assert [(s.name, s.job_id) for s in slots] == [
            ("slot1_1@drone.emulated", "7.0"),
            ("slot1_2@drone.emulated", "7.1"),
            ("slot1_3@drone.emulated", "7.2"),
        ]
        assert {(s.state, s.activity) for s in slots} == {("Claimed", "Busy")}


async def test_a_graceful_drain_lets_payloads_finish_and_ends_the_master(
    env: dict[str, str],
) -> None:
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        # long enough that the commands below, each a process of its own, find it running
        assert (await ep.offer("3.0", 6.0))["outcome"] == "started"
        result = await startd.drain("tardis: release")
        assert result.accepted, result.detail
        assert "Sent request to drain" in result.detail
        [slot] = await startd.slots()
        assert (slot.state, slot.activity, slot.job_id) == ("Claimed", "Retiring", "3.0")
        # the gate is still open, but a draining startd claims nothing
        assert (await ep.offer("4.0", 1))["reason"] == "draining"
        again = await startd.drain("again")
        assert not again.accepted
        assert "already draining" in again.detail
        assert "error code 10001" in again.detail
        assert "the startd is draining" in again.detail
        assert await master.wait() == 99  # MASTER.DAEMON_SHUTDOWN once the startd exited
        assert not await startd.ready()
        finished = await ep.wait_for("payload_finished", job_id="3.0")
        assert finished["runtime_s"] >= 5.99
        assert not [e for e in ep.ground_truth() if e["event"] == "payload_killed"]
        order = [e["event"] for e in ep.ground_truth()]
        assert order.index("drain_completed") > order.index("payload_finished")


async def test_a_fast_drain_replaces_a_graceful_one_and_kills(env: dict[str, str]) -> None:
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        await startd.set_accepting(True)
        assert (await ep.offer("5.0", 600))["outcome"] == "started"
        assert (await startd.drain("graceful first")).accepted
        fast = await startd.drain("deadline passed", fast=True)
        assert fast.accepted, fast.detail
        assert "graceful drain cancelled" in fast.detail
        killed = await ep.wait_for("payload_killed", job_id="5.0")
        assert killed["reason"] == "drain_fast"
        assert await master.wait() == 99
        drains = [
            (e["event"], e.get("how"), e.get("accepted"))
            for e in ep.ground_truth()
            if e["event"] in ("drain_requested", "drain_cancelled")
        ]
        assert drains == [
            ("drain_requested", "graceful", True),
            ("drain_requested", "fast", False),  # 10001: already draining
            ("drain_cancelled", None, None),
            ("drain_requested", "fast", True),
        ]


async def test_an_idle_startd_drains_at_once(env: dict[str, str]) -> None:
    master = EmulatedMaster(env)
    async with master as ep:
        startd = CondorStartd(env=env)
        assert (await startd.drain("idle")).accepted
        assert await master.wait() == 99
        assert [e["event"] for e in ep.ground_truth()][-3:] == [
            "drain_completed",
            "startd_exited",
            "master_exiting",
        ]


async def test_condor_drain_usage_errors_raise(tmp_path: Path, env: dict[str, str]) -> None:
    # an HTCondor older than 8.9.12 does not know -exit-on-completion
    old = tmp_path / "old-bin"
    _fake_tool(
        old,
        "condor_drain",
        'echo "ERROR: unexpected argument: -exit-on-completion" >&2\nexit 2\n',
    )
    async with EmulatedMaster(env):
        startd = CondorStartd(env={**env, "PATH": f"{old}{os.pathsep}{env['PATH']}"})
        assert await startd.ready()
        with pytest.raises(StartdError, match="rejected its arguments"):
            await startd.drain("x")


async def test_the_gate_attribute_is_restored_after_a_startd_restart(env: dict[str, str]) -> None:
    async with EmulatedMaster(env) as ep:
        startd = CondorStartd(env=env)
        assert await startd.ready()
        await startd.set_accepting(True)
        assert (await ep.request("restart_startd"))["ok"]
        first = first_startd_pid(ep)
        await ep.wait_for("startd_ready", where=lambda e: e["startd_pid"] != first)
        status = await ep.wait_ready()
        assert status["extras"] == {}  # lost with the old startd: START is false again
        assert await startd.ready()  # sees the new startd PID and sets the attribute again
        assert (await ep.status())["extras"] == {GATE_ATTRIBUTE: "True"}
        assert (await ep.offer("6.0", 30))["outcome"] == "started"


def first_startd_pid(ep: EmulatorControl) -> int:
    first = next(e for e in ep.ground_truth() if e["event"] == "startd_ready")
    return int(first["startd_pid"])


async def test_a_hanging_tool_is_killed(tmp_path: Path, env: dict[str, str]) -> None:
    hang = tmp_path / "hang-bin"
    pid_file = tmp_path / "who.pid"
    _fake_tool(hang, "condor_who", f"echo $$ > {pid_file}\nexec sleep 300\n")
    startd = CondorStartd(env={**env, "PATH": f"{hang}{os.pathsep}{env['PATH']}"}, timeout_s=0.5)
    with pytest.raises(StartdError, match="did not finish"):
        await startd.slots()
    assert not pid_exists(int(pid_file.read_text()))
    assert not await startd.ready()


async def test_missing_tools_are_a_startd_error(tmp_path: Path) -> None:
    startd = CondorStartd(env={"PATH": str(tmp_path)})
    with pytest.raises(StartdError, match="cannot run condor_who"):
        await startd.slots()
    assert not await startd.ready()
