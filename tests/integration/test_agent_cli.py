"""``cobald-remote agent run`` as a separate process: exit codes and last events"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nats.js import JetStreamContext
from support.agent import kinds, read_events
from support.processes import CLI, run_process

from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.protocol import events as ev

DRONE = "site1-00000000cc"


async def _agent(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    code, _, err = await run_process(*CLI, "agent", "run", *args, env={**os.environ, **(env or {})})
    return code, err


async def test_a_bad_configuration_exits_2() -> None:
    no_identity = {"TardisDroneUuid": "", "COBALD_REMOTE_DRONE": ""}
    code, err = await _agent("--url", "nats://127.0.0.1:1", "--", "true", env=no_identity)
    assert code == 2
    assert "no drone identity: set TardisDroneUuid" in err


async def test_the_agent_exits_with_the_workers_status(
    tmp_path: Path, nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    await provision(js)
    common = ["--no-startd", "--url", nats_server.url, "--drone", DRONE]
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
