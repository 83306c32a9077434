"""
The drone's end: what the batch system says of it, as a span; the runtime a payload's ad
gives; the gate's rule that a payload must end before the drone does
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from broker.manager.timeline import build, end_change
from remote_agent.agent.status import DroneStatus
from remote_agent.batchsystem import (
    BatchJob,
    EndUnknown,
    condor_job_limit,
    parse_slurm_time,
    span_until,
)
from remote_agent.classad import parse_ad
from remote_agent.errors import SettingsError
from remote_agent.jobruntime import format_attributes, parse_attributes, requested_runtime
from remote_agent.protocol import events as ev
from remote_agent.settings import DEFAULT_RUNTIME_ATTRIBUTES, Settings

BASE = {"TardisDroneUuid": "site1-0123456789", "COBALD_REMOTE_URL": "nats://127.0.0.1:4222"}
WORKER = ["condor_master", "-f"]


# --------------------------------------------------------------------------- the batch system


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("60", 3600.0),  # TARDIS's Walltime: plain minutes
        ("0", 0.0),
        ("90:30", 90 * 60 + 30.0),  # M:S
        ("1:02:03", 3723.0),  # H:M:S
        ("2-12", 2 * 86400 + 12 * 3600.0),  # D-H
        ("2-12:30", 2 * 86400 + 12 * 3600 + 30 * 60.0),  # D-H:M
        ("1-00:00:05", 86405.0),  # D-H:M:S
        (" 45 ", 2700.0),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_slurm_time_limits_in_every_format(text: str, seconds: float | None) -> None:
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["", "-5", "1.5", "1:2:3:4", "1-", "an hour", "1-2-3"])
def test_what_is_no_slurm_time_limit(text: str) -> None:
    with pytest.raises(ValueError, match="no Slurm time limit"):
        parse_slurm_time(text)


def test_the_batch_job_from_its_environment(tmp_path: Path) -> None:
    env = {
        "SLURM_JOB_ID": "4711",
        "SLURM_JOB_END_TIME": "1800000000",
        "_CONDOR_JOB_AD": str(tmp_path / ".job.ad"),
    }
    job = BatchJob.from_env(env)
    assert job == BatchJob("4711", 1_800_000_000.0, tmp_path / ".job.ad")
    # what is no job id, no epoch second or no absolute path counts as absent
    garbage = {"SLURM_JOB_ID": "47;11", "SLURM_JOB_END_TIME": "-1", "_CONDOR_JOB_AD": "ad"}
    assert BatchJob.from_env(garbage) == BatchJob()
    assert BatchJob.from_env({}) == BatchJob()


def test_an_absolute_end_becomes_a_span_on_the_nodes_clock_at_once() -> None:
    assert span_until(1_800_000_100.0, now=1_800_000_000.0) == 100.0
    # a drone whose clock is a day ahead of the batch system's: no span, not "ended"
    with pytest.raises(EndUnknown, match="the clocks disagree"):
        span_until(1_800_000_100.0, now=1_800_000_000.0 + 86400)


def test_an_htcondor_jobs_limits_from_its_job_ad(tmp_path: Path) -> None:
    ad = tmp_path / ".job.ad"
    ad.write_text(
        'ClusterId = 12\nAllowedJobDuration = 7200\nAllowedExecuteDuration = 3600\nOwner = "a"\n'
    )
    assert condor_job_limit(ad) == 3600.0
    ad.write_text("AllowedJobDuration = MY.Other * 2\nAllowedExecuteDuration = -1\n")
    with pytest.raises(EndUnknown, match="sets no limit"):
        condor_job_limit(ad)
    with pytest.raises(EndUnknown, match="cannot read"):
        condor_job_limit(tmp_path / "missing.ad")


# --------------------------------------------------------------------------- the settings


def test_the_walltime_comes_from_tardis_unless_given() -> None:
    settings = Settings.from_env({**BASE, "SLURM_Walltime": "60"}, worker_command=WORKER)
    assert settings.walltime_s == 3600.0
    env = {**BASE, "SLURM_Walltime": "60", "COBALD_REMOTE_WALLTIME_S": "900"}
    assert Settings.from_env(env, worker_command=WORKER).walltime_s == 900.0
    assert Settings.from_env(env, worker_command=WORKER, walltime_s=60.0).walltime_s == 60.0
    assert Settings.from_env(BASE, worker_command=WORKER).walltime_s is None
    with pytest.raises(SettingsError, match="invalid SLURM_Walltime='soon'"):
        Settings.from_env({**BASE, "SLURM_Walltime": "soon"}, worker_command=WORKER)


def test_the_end_settings_and_their_defaults() -> None:
    settings = Settings.from_env(BASE, worker_command=WORKER)
    assert (settings.end_margin_s, settings.payload_runtime_s) == (30.0, 0.0)
    assert (settings.term_grace_s, settings.warning_grace_s) == (30.0, 60.0)
    assert settings.runtime_attributes == DEFAULT_RUNTIME_ATTRIBUTES
    env = {
        **BASE,
        "COBALD_REMOTE_END_MARGIN_S": "5",
        "COBALD_REMOTE_TERM_GRACE_S": "20",
        "COBALD_REMOTE_WARNING_GRACE_S": "300",
        "COBALD_REMOTE_PAYLOAD_RUNTIME_S": "3600",
        "COBALD_REMOTE_RUNTIME_ATTRIBUTES": "RequestRuntime:h",
        "SLURM_JOB_ID": "12",
    }
    settings = Settings.from_env(env, worker_command=WORKER)
    assert (settings.end_margin_s, settings.payload_runtime_s) == (5.0, 3600.0)
    assert (settings.term_grace_s, settings.warning_grace_s) == (20.0, 300.0)
    assert settings.runtime_attributes == (("RequestRuntime", 3600.0),)
    assert settings.batch.slurm_job_id == "12"


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"COBALD_REMOTE_WALLTIME_S": "0"}, "walltime_s must be a finite positive number"),
        ({"COBALD_REMOTE_END_MARGIN_S": "-1"}, "end_margin_s must be a finite number >= 0"),
        ({"COBALD_REMOTE_TERM_GRACE_S": "inf"}, "term_grace_s must be a finite number"),
        ({"COBALD_REMOTE_WARNING_GRACE_S": "nan"}, "warning_grace_s must be a finite number"),
        ({"COBALD_REMOTE_RUNTIME_ATTRIBUTES": "A:days"}, "unit 'days' of A is not one of"),
        ({"COBALD_REMOTE_RUNTIME_ATTRIBUTES": "My.A:s"}, "'My.A' is no job ad attribute name"),
    ],
)
def test_bad_end_settings_are_refused(env: dict[str, str], error: str) -> None:
    with pytest.raises(SettingsError, match=error):
        Settings.from_env({**BASE, **env}, worker_command=WORKER)


# --------------------------------------------------------------------------- the payload's runtime


def test_the_default_attributes_and_their_units() -> None:
    assert format_attributes(DEFAULT_RUNTIME_ATTRIBUTES) == (
        "MaxWallTimeMins:min,OriginalMaxWallTimeMins:min,maxWallTime:min,"
        "AllowedJobDuration:s,AllowedExecuteDuration:s"
    )
    assert parse_attributes(format_attributes(DEFAULT_RUNTIME_ATTRIBUTES)) == (
        DEFAULT_RUNTIME_ATTRIBUTES
    )
    assert parse_attributes("A, B:h ,") == (("A", 1.0), ("B", 3600.0))


@pytest.mark.parametrize(
    ("ad", "seconds"),
    [
        ("MaxWallTimeMins = 90", 5400.0),  # CRAB's number
        # WMAgent's expression is not evaluated: its literal estimate counts
        (
            "MaxWallTimeMins = WMCore_ResizeJob ? (EstimatedSingleCoreMins/RequestCpus + 15)"
            " : OriginalMaxWallTimeMins\nOriginalMaxWallTimeMins = 720",
            43200.0,
        ),
        ("maxWallTime = 2880", 172800.0),  # ATLAS, through an HTCondor-CE
        ("AllowedJobDuration = 600\nmaxwalltimemins = 1", 60.0),  # names are case-insensitive
        ("AllowedExecuteDuration = 12.5", 12.5),
        ("MaxWallTimeMins = true\nAllowedJobDuration = 30", 30.0),  # a bool is no number
        ("MaxWallTimeMins = -5\nAllowedJobDuration = 1e400", None),  # negative, infinite
        ('MaxWallTimeMins = "60"', None),  # a string is no number
        ("Cmd = /bin/sleep", None),
    ],
)
def test_the_first_attribute_the_ad_carries_as_a_number(ad: str, seconds: float | None) -> None:
    assert requested_runtime(parse_ad(ad), DEFAULT_RUNTIME_ATTRIBUTES) == seconds


# --------------------------------------------------------------------------- the gate's rule


def test_a_payload_must_end_a_margin_before_the_drone() -> None:
    status = DroneStatus(1, ev.utcnow())
    assert status.end_refusal(1e9, margin_s=30.0) is None  # no end known: anything fits
    status.end_at = time.monotonic() + 1000.0
    assert status.end_refusal(900.0, margin_s=30.0) is None
    why = status.end_refusal(990.0, margin_s=30.0)
    assert why is not None and "may run 990s" in why and "30s of it kept" in why
    assert status.end_refusal(0.0, margin_s=2000.0) is not None  # the margin alone is too long
    end = status.snapshot().end
    assert end is not None and 990 < end.in_s <= 1000.0 and end.notice == ""
    status.end_at = time.monotonic() - 5.0
    end = status.snapshot().end
    assert end is not None and end.in_s == 0.0  # past: no negative span on the wire


# --------------------------------------------------------------------------- the timeline


def _beat(seq: int, end: ev.DroneEnd | None) -> ev.Heartbeat:
    at = dt.datetime(2026, 3, 18, 12, 0, seq, tzinfo=dt.UTC)
    snapshot = ev.Snapshot(
        state=ev.DroneState.IDLE, since=at, gate_open=True, started_at=at, end=end
    )
    return ev.Heartbeat(
        site="site1",
        drone="site1-0123456789",
        incarnation="i1",
        seq=seq,
        at=at,
        id=f"i{seq}",
        snapshot=snapshot,
        interval_s=30.0,
    )


def test_the_timeline_shows_the_end_when_known_and_the_notice() -> None:
    planned = ev.DroneEnd(in_s=3600.0, source="squeue")
    notice = ev.DroneEnd(in_s=30.0, source="notice", notice="SIGTERM")
    assert end_change(None, None) is None
    assert end_change(None, planned) == "end known: in 3600s (squeue)"
    assert end_change(planned, planned) is None
    assert end_change(planned, notice) == "end notice (SIGTERM): the drone ends in 30s"
    messages: list[tuple[int, ev.Message]] = [
        (1, _beat(1, None)),
        (2, _beat(2, planned)),
        (3, _beat(3, ev.DroneEnd(in_s=3570.0, source="squeue"))),
        (4, _beat(4, notice)),
        (5, _beat(5, notice)),
    ]
    assert [row.drone_event for row in build(messages)] == [
        "end known: in 3600s (squeue)",
        "end notice (SIGTERM): the drone ends in 30s",
    ]
