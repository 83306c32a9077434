"""``cobald-remote agent run`` as a separate process: exit codes and last events"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nats.js import JetStreamContext
from support.agent import kinds, read_events
from support.processes import CLI, run_process
from support.servers import drone_creds

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.protocol import events as ev

DRONE = "site1-00000000cc"


async def _agent(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    code, _, err = await run_process(*CLI, "agent", "run", *args, env={**os.environ, **(env or {})})
    return code, err


async def test_a_bad_configuration_exits_2() -> None:
    no_identity = {"TardisDroneUuid": "", "COBALD_REMOTE_DRONE": ""}
    code, err = await _agent("--server", "nats://127.0.0.1:1", "--", "true", env=no_identity)
    assert code == 2
    assert "no drone identity: set TardisDroneUuid" in err


async def test_the_agent_exits_with_the_workers_status(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    common = ["--no-startd", "--server", nats_server.url, "--drone", DRONE]
    common += ["--spool-dir", str(tmp_path / "spool"), "--log-level", "info", "--"]
    code, err = await _agent(*common, "sh", "-c", "exit 3")
    assert code == 3
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("worker_exited") for line in lines)
    assert all(line.get("drone", DRONE) == DRONE for line in lines)
    assert (await kinds(js, DRONE))[-3:] == ["worker_exited", "agent_exiting", "heartbeat"]

    code, err = await _agent(*common, str(tmp_path / "no-such-worker"))
    assert code == 127
    events = [e for _, e in await read_events(js, DRONE)]
    exiting = events[-2]
    assert isinstance(exiting, ev.AgentExiting) and exiting.exit_code == 127
    assert "cannot start the worker" in exiting.reason
    assert isinstance(events[-1], ev.Heartbeat)


async def test_another_drones_credentials_are_named_as_such(
    secured: tuple[EmbeddedServer, Path], tmp_path: Path
) -> None:
    server, authority = secured
    creds = drone_creds(tmp_path, authority, "site1", "site1-00000000aa")  # not this drone's
    code, err = await _agent(
        *("--no-startd", "--server", server.url, "--creds", str(creds), "--drone", DRONE),
        *("--spool-dir", str(tmp_path / "spool"), "--", "sleep", "600"),
    )
    assert code == 1
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    errors = [line["message"] for line in lines if line["level"] == "ERROR"]
    assert len(errors) == 1
    assert "these credentials are not this drone's" in errors[0]
    assert "nats: nats:" not in err
    assert not any("cannot claim the handshake record" in line["message"] for line in lines)
    (exiting,) = [line["message"] for line in lines if "exiting with" in line["message"]]
    assert "these credentials are not this drone's" in exiting
    assert "broker unreachable" not in err


async def test_a_worker_that_is_not_installed_is_named_without_python_warnings(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    # docs/htcondor.md's worker on a node without HTCondor
    await provision(js)
    code, err = await _agent(
        *("--server", nats_server.url, "--drone", DRONE, "--spool-dir", str(tmp_path / "spool")),
        *("--", "condor_master", "-f"),
        env={"PATH": str(tmp_path)},
    )
    assert code == 127
    assert "Warning" not in err
    assert "never awaited" not in err
    lines = [json.loads(line) for line in err.splitlines()]  # JSON lines alone
    errors = [line["message"] for line in lines if line["level"] == "ERROR"]
    assert errors == [
        f"cannot start the worker ['condor_master', '-f']: condor_master not found: not "
        f"installed here, or not on PATH ({tmp_path})"
    ]


async def test_the_spool_directory_is_the_jobs_own_and_goes_with_it(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    job = tmp_path / "job"  # what a Slurm site's prolog makes, as SLURM_TMPDIR
    job.mkdir()
    env = {"SLURM_TMPDIR": str(job), "TMPDIR": str(tmp_path / "shared")}
    code, err = await _agent(
        *("--no-startd", "--server", nats_server.url, "--drone", DRONE, "--"),
        *("sh", "-c", f"test -s {job}/cobald-remote-{DRONE}/events.spool"),
        env={**env, "_CONDOR_SCRATCH_DIR": ""},
    )
    assert code == 0, err  # the spool was in the job's directory while it ran
    assert list(job.iterdir()) == [] and not (tmp_path / "shared").exists()
    assert (await kinds(js, DRONE))[-2:] == ["agent_exiting", "heartbeat"]

    # events it could not publish stay, for an agent started again in the same job
    code, err = await _agent(
        *("--no-startd", "--server", "nats://127.0.0.1:1", "--drone", DRONE),
        *("--exit-flush", "0", "--", "true"),
        env={**env, "_CONDOR_SCRATCH_DIR": ""},
    )
    assert code == 0
    assert (job / f"cobald-remote-{DRONE}" / "events.spool").is_file()
    assert f"keeping {job}/cobald-remote-{DRONE}: " in err
