"""
Drones whose clocks are wrong, under Debian's ``faketime``: the real agent as a process whose
wall clock is a day, ten days or ten years off, against a manager on the right time

Nothing the manager decides may rest on a drone's clock: the drone must be neither removed,
lost, retired nor released wrongly, and its drain deadline counts as the span it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from support.bootstrap import manager_settings, minted, site_bootstrap
from support.manager import running_manager
from support.processes import CLI, run_process, start_process
from support.waiting import wait_until

from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.manager.verdict import Removal
from broker.manager.views import DroneView
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.gate.paths import GATE_ENV, PYTHON_ENV
from remote_agent.protocol import events as ev
from remote_agent.settings import SETTINGS_ENV

#: Debian's libfaketime (package ``faketime``), preloaded into the agent: the ``faketime``
#: wrapper would name a semaphore after its PID and leave it behind when the test stops it,
#: and a later wrapper given the same PID fails ("sem_open: File exists")
LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)

pytestmark = pytest.mark.skipif(LIBFAKETIME is None, reason="Debian's faketime is not installed")

SITE = "site1"
#: a day and an hour ahead (TARDIS's 24 h drain looks expired), ten days behind, ten years ahead
OFFSETS = ["+25h", "-10d", "+10y"]
#: the manager calls a drone lost after this much silence; the agents beat five times as often
LOST_AFTER_S = 2.0
HEARTBEAT_S = 0.2


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _job_ad(job_id: str) -> bytes:
    cluster, _, proc = job_id.partition(".")
    return f'ClusterId = {cluster}\nProcId = {proc}\nRemoteHost = "slot1@wn042"\n'.encode()


@contextlib.asynccontextmanager
async def skewed_agent(
    tmp_path: Path,
    offset: str,
    url: str,
    drone: str,
    *options: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Path]:
    """
    ``cobald-remote agent run`` for ``drone`` with libfaketime's clock ``offset`` (as
    ``faketime -f offset`` runs it; no startd: its payloads pass the gate hooks alone); yields
    its gate socket; stopped (SIGTERM) at the end
    """
    spool = tmp_path / drone
    faked = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset}
    proc = await start_process(
        *CLI,
        "agent",
        "run",
        "--no-startd",
        "--url",
        url,
        "--drone",
        drone,
        "--spool-dir",
        str(spool),
        "--heartbeat",
        str(HEARTBEAT_S),
        "--log-level",
        "warning",
        *options,
        "--",
        "sleep",
        "1000",
        env={**os.environ, "COBALD_REMOTE_RECONNECT_WAIT_S": "0.1", **faked, **(env or {})},
        start_new_session=True,  # the agent and its worker: stop them as a group
    )
    try:
        yield spool / "gate.sock"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await wait_until(lambda: not _group_alive(proc.pid), what="the agent's processes to end")


async def _start_payload(gate: Path, job_id: str) -> None:
    """A payload passes the gate as HTCondor's starter would let it (HOOK_PREPARE_JOB)"""
    env = {**os.environ, GATE_ENV: str(gate), PYTHON_ENV: sys.executable}
    code, out, err = await run_process(
        sys.executable, "-m", "remote_agent.hooks", "prepare-job", input=_job_ad(job_id), env=env
    )
    assert (code, out) == (0, ""), err


def _view(registry: Registry, drone: str) -> DroneView:
    view = registry.view(SITE, drone)
    assert view is not None
    return view


def _busy(registry: Registry, drone: str) -> bool:
    view = registry.view(SITE, drone)
    return view is not None and len(view.payloads) == 1


def _settings(server: EmbeddedServer) -> ManagerSettings:
    return ManagerSettings(servers=[server.url], lost_after_s=LOST_AFTER_S, retry_s=0.2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offset", OFFSETS)
async def test_a_wrong_clock_neither_ends_a_drain_early_nor_late(
    tmp_path: Path,
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    offset: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """
    Two drones on a wrong clock, each running a payload: one drained as TARDIS drains (a
    day), one with a deadline of seconds. The short drain expires after its seconds, not
    at once and not days later; the day's drain stays a drain throughout, and nothing about
    either drone is decided by its clock.
    """
    await provision(js)
    day, short = "site1-00000000da", "site1-00000000d5"
    caplog.set_level(logging.WARNING, "cobald.runtime.cobald_remote.registry")
    async with (
        running_manager(_settings(nats_server)) as service,
        skewed_agent(tmp_path, offset, nats_server.url, day) as day_gate,
        skewed_agent(tmp_path, offset, nats_server.url, short) as short_gate,
    ):
        registry, control = service.registry, service.control
        assert control is not None
        for drone, gate in ((day, day_gate), (short, short_gate)):
            await wait_until(
                lambda d=drone: (
                    (v := registry.view(SITE, d)) is not None
                    and v.phase is ev.RecordPhase.UP
                    and v.snapshot is not None
                    and v.snapshot.gate_open
                ),
                timeout_s=60,
                what=f"{drone}'s gate to open",
            )
            await _start_payload(gate, "7.0")
            await wait_until(lambda d=drone: _busy(registry, d), what=f"{drone}'s payload")

        # the wrong clocks are seen and said, and change nothing else
        await wait_until(lambda: registry.metrics().clock_skewed == 2, what="both clocks flagged")
        assert "the clock of drone site1/" in caplog.text
        offset_s = _view(registry, day).clock_offset_s
        assert offset_s is not None and (offset_s > 0) is offset.startswith("+")

        now = ev.utcnow()
        tardis = await control.drain(SITE, day, now + dt.timedelta(hours=24), "TARDIS drain")
        quick = await control.drain(SITE, short, now + dt.timedelta(seconds=3), "operator drain")
        assert tardis.intent is not None and quick.intent is not None
        assert (str(tardis.outcome), str(quick.outcome)) == ("accepted", "accepted")

        # the short drain expires on the manager's time, with its payload still running
        await wait_until(
            lambda: _view(registry, short).phase is ev.RecordPhase.DEADLINE_EXPIRED,
            timeout_s=60,
            what="the short drain's deadline",
        )
        record = _view(registry, short).record
        assert record is not None and record.stored is not None
        assert record.stored >= quick.intent.deadline.timestamp(), "expired before its deadline"
        verdict = control.may_remove(SITE, short, lbs_running=True)
        assert (verdict.allowed, verdict.reason) == (True, Removal.DEADLINE_EXPIRED), verdict
        assert _busy(registry, short), "the deadline policy is wait: the payload still runs"

        # the day's drain, given as long and more since: still a drain, the payload runs
        beats = _view(registry, day).heartbeat_seq or 0
        await wait_until(
            lambda: (_view(registry, day).heartbeat_seq or 0) > beats + 5,
            what="more of the drained drone's heartbeats",
        )
        view = _view(registry, day)
        assert view.phase is ev.RecordPhase.DRAINING
        assert view.state is ev.DroneState.DRAINING and _busy(registry, day)
        verdict = control.may_remove(SITE, day, lbs_running=True)
        assert (verdict.allowed, verdict.reason) == (False, Removal.DRAINING), verdict
        released = await control.release(SITE, day, note="TARDIS shrinks the pool")
        assert str(released.outcome) != "released", released
        assert not any(v.counts_lost(time.time(), LOST_AFTER_S) for v in registry.views().values())
        assert not registry.due_retirements(time.time())
        assert not view.ended


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offset", ["+25h", "-10d"])
async def test_a_bootstrapped_drone_on_a_wrong_clock_enrolls_and_renews_in_time(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], offset: str
) -> None:
    """
    Its JWTs live four seconds: a drone that judged them by its own clock would renew in a
    loop (ahead) or too late, lose its connection and fall silent (behind)
    """
    server, authority = secured
    drone = "site1-00000000b0"
    settings = dataclasses.replace(
        manager_settings(tmp_path, server, authority, jwt_valid_s=4.0),
        lost_after_s=LOST_AFTER_S,
    )
    service: ManagerService
    async with running_manager(settings) as service:
        token = await minted(service, drone)
        creds = site_bootstrap(tmp_path, authority)
        async with skewed_agent(
            tmp_path,
            offset,
            server.url,
            drone,
            "--bootstrap-creds",
            str(creds),
            env={SETTINGS_ENV["bootstrap_token"]: token},
        ):
            registry = service.registry
            await wait_until(
                lambda: (
                    (v := registry.view(SITE, drone)) is not None and v.phase is ev.RecordPhase.UP
                ),
                timeout_s=60,
                what="the drone to enroll and claim",
            )
            assert service.issuer_counts["issued_enroll"] == 1
            assert service.issuer_counts["clock_skewed"] >= 1
            # renewed at half of each lifetime, counted on the monotonic clock: three
            # renewals span three JWTs, and the drone spoke throughout
            await wait_until(
                lambda: service.issuer_counts["issued_renew"] >= 3,
                timeout_s=60,
                what="three renewals",
            )
            renewed = time.time()
            await wait_until(
                lambda: (_view(registry, drone).heartbeat_time or 0) > renewed + 1,
                what="heartbeats on the renewed identity",
            )
            assert service.issuer_counts["issued_renew"] < 12, "renewing in a loop"
            assert not _view(registry, drone).counts_lost(time.time(), LOST_AFTER_S)
            assert service.registry.metrics().lost == 0
