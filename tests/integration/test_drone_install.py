"""
The drone image's install steps, run as the recipes run them: ``install-drone`` from
the built wheel into a fresh venv, offline, then the installed drone job in that venv
around an emulated startd that uses the installed hooks and startd configuration

The script is the shipped file itself (``deploy/image/install-drone``),
with its paths in temporary directories and the wheels of the dependencies repacked
from this environment (``PIP_NO_INDEX``: nothing is downloaded). The fake ``condor_*``
tools come from the checkout's emulation, which a drone install does not have; they
run under this interpreter with the checkout on their own ``sys.path`` only, so the
agent and the hooks import nothing but the install.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from support import wheels
from support.agent import kinds
from support.processes import start_process

from broker.emulation.execution_point import EmulatorControl, install_fake_condor
from broker.server.embedded import EmbeddedServer
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore

pytestmark = pytest.mark.timeout(180)

INSTALL_DRONE = DEPLOY_DIR / "image" / "install-drone"
SITE = "site1"
DRONE = "site1-00000000d1"


@dataclass(frozen=True)
class Drone:
    """Where install-drone put things (its ``PREFIX``, ``LIBEXEC``, ``CONDOR_CONFIG_D``)"""

    prefix: Path
    libexec: Path
    config: Path  #: the startd configuration it wrote


@pytest.fixture(scope="module")
def drone(tmp_path_factory: pytest.TempPathFactory) -> Drone:
    root = tmp_path_factory.mktemp("drone-image")
    found = root / "wheels"
    wheel, _ = wheels.build(found)
    wheels.dependency_wheels(wheel, found)
    done = subprocess.run(
        ["sh", str(INSTALL_DRONE), str(found)],
        env=wheels.clean_env(
            PYTHON=sys.executable,
            PREFIX=str(root / "opt"),
            LIBEXEC=str(root / "libexec"),
            CONDOR_CONFIG_D=str(root / "config.d"),
            PIP_NO_INDEX="1",
            PIP_DISABLE_PIP_VERSION_CHECK="1",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return Drone(root / "opt", root / "libexec", root / "config.d" / "90-cobald-remote.conf")


def _python(drone: Drone, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(drone.prefix / "bin" / "python"), "-c", code],
        capture_output=True,
        cwd=drone.prefix,
        env=wheels.clean_env(),
        text=True,
        timeout=60,
    )


def test_the_install_is_the_drone_side_from_the_wheel(drone: Drone) -> None:
    assert _python(drone, "import tardis").returncode == 1
    assert _python(drone, "import cobald").returncode == 1
    where = _python(drone, "import broker, remote_agent; print(remote_agent.__file__)")
    assert where.stdout.startswith(str(drone.prefix)), where.stderr
    # pip and setuptools are gone once the drone side is in: the venv is what runs
    assert _python(drone, "import pip").returncode == 1
    (site,) = drone.prefix.glob("lib/python3*/site-packages")
    size = sum(path.stat().st_size for path in site.rglob("*") if path.is_file())
    print(f"site-packages of the drone install: {size / 1e6:.1f} MB")
    assert size < 30e6, "the drone side should stay under 30 MB"


def test_the_startd_configuration_names_installed_files(drone: Drone) -> None:
    knobs = dict(re.findall(r"^(\w+) = (.*)$", drone.config.read_text(), re.M))
    assert knobs["COBALD_REMOTE_LIBEXEC"] == str(drone.libexec)  # the last value wins
    named = [value for value in knobs.values() if "$(COBALD_REMOTE_LIBEXEC)" in value]
    assert len(named) == 2  # the two job hooks
    for value in named:
        path = Path(value.replace("$(COBALD_REMOTE_LIBEXEC)", str(drone.libexec)))
        assert path.is_file() and os.access(path, os.X_OK), path
    assert os.access(drone.libexec / "drone-job", os.X_OK)
    installed = sorted(path.name for path in drone.libexec.iterdir())
    assert installed == ["drone-job", "hook-job-exit", "hook-prepare-job"]
    assert [path.name for path in drone.config.parent.iterdir()] == [drone.config.name]


def _emulator_python(where: Path) -> Path:
    """An interpreter line for the fake tools: this Python, the checkout on its path only"""
    boot = (
        f"import runpy, sys; sys.path.insert(0, {str(wheels.ROOT)!r}); sys.argv.pop(0); "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    where.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "{boot}" "$@"\n')
    where.chmod(0o755)
    return where


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until it holds (a minute at most)"""
    for _ in range(1200):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def _published(js: JetStreamContext, kind: str) -> None:
    """Wait until the drone has published an event of ``kind``"""

    async def seen() -> bool:
        return kind in await kinds(js, DRONE)

    await _until(seen, kind)


async def test_the_installed_drone_job_runs_agent_and_hooks(
    drone: Drone,
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    store: RecordStore,
    tmp_path: Path,
) -> None:
    path = os.pathsep.join([str(drone.prefix / "bin"), wheels.clean_env()["PATH"]])
    env = install_fake_condor(
        tmp_path / "bin",
        tmp_path / "ep",
        slots=1,
        deploy_config=drone.config,
        libexec=drone.libexec,
        python=str(_emulator_python(tmp_path / "emulator-python")),
        environ=wheels.clean_env(PATH=path),
    )
    del env["COBALD_REMOTE_PYTHON"]  # the agent exports its own to the hooks
    env.update(
        {
            # what TARDIS and the decorators put into the job's environment
            "TardisDroneUuid": DRONE,
            "TardisDroneCobaldRemoteUrl": nats_server.url,
            "TardisDroneCobaldRemoteSite": SITE,
            "COBALD_REMOTE_SPOOL_DIR": str(tmp_path / "spool"),
            "COBALD_REMOTE_POLL_S": "0.2",
            "_CONDOR_SCRATCH_DIR": str(tmp_path),  # the batch job's, for the drone's HTCondor
        }
    )
    with (tmp_path / "drone-job.err").open("wb") as err:
        job = await start_process(
            drone.libexec / "drone-job", env=env, cwd=tmp_path, stdout=err, stderr=err
        )
    try:
        await _published(js, "gate_opened")
        versioned = await store.read(SITE, DRONE)
        assert versioned is not None and versioned.record.phase is ev.RecordPhase.UP
        ep = EmulatorControl(tmp_path / "ep")

        async def gate_set() -> bool:  # the agent sets the startd's gate after the claim
            return bool((await ep.status())["extras"].get("DroneGateOpen") == "True")

        await _until(gate_set, "DroneGateOpen in the startd's ad")
        # the emulated startd runs the installed PREPARE_JOB hook; the gate says yes
        reply = await ep.offer("7.0", 0.2, owner="alice")
        assert reply["outcome"] == "started", reply
        await _published(js, "payload_finished")
        await ep.wait_for("job_exit", job_id="7.0", exit_status=0)  # the installed JOB_EXIT hook
        [prepare] = [e for e in ep.ground_truth() if e["event"] == "prepare_job"]
        assert (prepare["decision"], prepare["hook_status_code"]) == ("run", None), prepare
    finally:
        job.send_signal(signal.SIGTERM)  # the batch system ends the job
        code = await asyncio.wait_for(job.wait(), 60)
    assert code == 0, (tmp_path / "drone-job.err").read_text()
    assert {"agent_started", "payload_started", "agent_exiting"} <= set(await kinds(js, DRONE))
