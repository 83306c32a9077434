"""
broker/emulation/site/schedd.py and broker/emulation/site/collector.py: the fake schedd and
collector tools read what TARDIS's HTCondor adapters send, and fail clearly otherwise
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tardis.adapters.sites.htcondor import _submit_description

from broker.emulation.site.collector import COLLECTOR, install_fake_collector
from broker.emulation.site.schedd import install_fake_schedd, parse_environment, parse_submit


def test_jobs_of_a_bulk_submission_as_tardis_writes_it() -> None:
    jdls = (
        "executable = /bin/a\nenvironment = TardisDroneUuid=site1-01;TardisDroneCores=8\n",
        "executable = /bin/b\nEnvironment = TardisDroneUuid=site1-02\n",
    )
    jobs = parse_submit(_submit_description(jdls))  # TARDIS appends "queue 1" to each
    assert [job["executable"] for job in jobs] == ["/bin/a", "/bin/b"]
    assert parse_environment(jobs[0]["environment"]) == {
        "TardisDroneUuid": "site1-01",
        "TardisDroneCores": "8",
    }
    assert parse_submit("a = 1\n# comment\nqueue 3\n") == [{"a": "1"}] * 3


def test_environment_in_both_syntaxes() -> None:
    assert parse_environment("A=1;B=x=y") == {"A": "1", "B": "x=y"}
    assert parse_environment('"A=1 B=2"') == {"A": "1", "B": "2"}
    with pytest.raises(ValueError, match="not emulated"):
        parse_environment("\"A='1 2'\"")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_environment("justaword")


def _run(tool: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tool), *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def test_tools_fail_clearly_without_a_schedd_or_for_other_invocations(tmp_path: Path) -> None:
    bin_dir = install_fake_schedd(tmp_path / "bin", tmp_path / "no.sock", python=sys.executable)
    q = _run(bin_dir / "condor_q", "1.0", "-af:t", "JobStatus")
    assert q.returncode == 1 and "schedd" in q.stderr
    other = _run(bin_dir / "condor_q", "-long")
    assert other.returncode == 1 and "not emulated" in other.stderr
    rm = _run(bin_dir / "condor_rm", "-all")
    assert rm.returncode == 1 and "not emulated" in rm.stderr
    submit = _run(bin_dir / "condor_submit", "-verbose", "-maxjobs", "1", stdin="a = 1\n")
    assert submit.returncode == 1 and "no queue statement" in submit.stderr


def test_the_collector_answers_tardis_collector_queries(tmp_path: Path) -> None:
    """What ``htcondor_get_collector_start_dates`` asks before every status update"""
    bin_dir = install_fake_collector(tmp_path / "bin", tmp_path / "no.sock")
    collectors = _run(bin_dir / "condor_status", "-af:t", "Machine", "-collector")
    assert (collectors.returncode, collectors.stdout) == (0, f"{COLLECTOR}\n")
    masters = _run(
        bin_dir / "condor_status",
        "-af:t",
        "Machine",
        "DaemonStartTime",
        "-constraint",
        f'Machine == "{COLLECTOR}"',
        "-master",
    )
    machine, started = masters.stdout.strip().split("\t")
    assert machine == COLLECTOR and started.isdigit()
    # startds: the overlay pool is not running here
    startds = _run(bin_dir / "condor_status", "-af:t", "Name", "-constraint", "true")
    assert startds.returncode == 1 and "condor_collector" in startds.stderr
    assert _run(bin_dir / "condor_status", "-long").returncode == 1
    drain = _run(bin_dir / "condor_drain", "-graceful", "slot1@x.overlay")
    assert drain.returncode == 1 and "Can't find address" in drain.stderr
