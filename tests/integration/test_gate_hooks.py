"""
The job hook commands, run as HTCondor runs them (subprocesses, ad on stdin),
against a gate served in this test's event loop
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from support.gate import FakeAgent, GateFactory
from support.processes import CLI, run_process

from broker.emulation.execution_point import DEPLOY_DIR
from remote_agent.classad import parse_ad
from remote_agent.gate.paths import GATE_ENV, PYTHON_ENV
from remote_agent.gate.server import GateServer
from remote_agent.interfaces import AGENT_UNREACHABLE_STATUS, GATE_CLOSED_STATUS, JobStart
from remote_agent.jobruntime import RUNTIME_ENV, format_attributes
from remote_agent.protocol.events import PayloadEnd
from remote_agent.settings import DEFAULT_RUNTIME_ATTRIBUTES as DEFAULTS

JOB_AD = b"""\
ClusterId = 4711
ProcId = 2
Owner = "alice"
RemoteHost = "slot1_3@glidein_9@wn042.example.org"
Cmd = "/usr/bin/payload"
"""

#: the three ways the hook can be run
MODULE = [sys.executable, "-m", "remote_agent.hooks"]
AGENT_HOOK = [*CLI, "agent", "hook"]


async def run_hook(
    argv: Sequence[str | Path], stdin: bytes, env: dict[str, str], timeout_s: float = 60.0
) -> tuple[int, str, str]:
    """Exit code, stdout and stderr; the test fails if the hook runs past ``timeout_s``"""
    return await run_process(*argv, input=stdin, env=env, timeout_s=timeout_s)


def hook_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != GATE_ENV}
    return {**env, PYTHON_ENV: sys.executable, **extra}


@pytest.fixture
async def gate(start_gate: GateFactory) -> tuple[GateServer, FakeAgent]:
    return await start_gate()


@pytest.mark.parametrize(
    "argv",
    [
        [*MODULE, "prepare-job"],
        [*AGENT_HOOK, "prepare-job"],
        [DEPLOY_DIR / "hook-prepare-job"],
    ],
    ids=["module", "cli", "wrapper"],
)
async def test_prepare_job_allows_silently(
    gate: tuple[GateServer, FakeAgent], argv: list[str | Path]
) -> None:
    server, agent = gate
    code, out, _ = await run_hook(argv, JOB_AD, hook_env(**{GATE_ENV: str(server.path)}))
    assert (code, out) == (0, "")
    assert agent.started == [
        JobStart(job_id="4711.2", slot="slot1_3@glidein_9@wn042.example.org", owner="alice")
    ]


@pytest.mark.parametrize(
    ("ad", "requested_s"),
    [
        (b"MaxWallTimeMins = 90\n", 5400.0),
        (
            b"MaxWallTimeMins = Retry ? 60 : OriginalMaxWallTimeMins\n"
            b"OriginalMaxWallTimeMins = 30\n",
            1800.0,
        ),
        (b"AllowedJobDuration = 120\n", 120.0),
        (b"", None),
    ],
)
async def test_prepare_job_tells_the_runtime_the_ad_requests(
    gate: tuple[GateServer, FakeAgent], ad: bytes, requested_s: float | None
) -> None:
    """By the attributes the agent names in the worker's environment (its default list)"""
    server, agent = gate
    env = hook_env(**{GATE_ENV: str(server.path), RUNTIME_ENV: format_attributes(DEFAULTS)})
    code, out, _ = await run_hook([*MODULE, "prepare-job"], JOB_AD + ad, env)
    assert (code, out) == (0, "")
    [started] = agent.started
    assert started.requested_s == requested_s


@pytest.mark.parametrize(
    "argv", [[*MODULE, "prepare-job"], [DEPLOY_DIR / "hook-prepare-job"]], ids=["module", "wrapper"]
)
async def test_prepare_job_refuses_with_390_and_exits_0(
    gate: tuple[GateServer, FakeAgent], argv: list[str | Path]
) -> None:
    server, agent = gate
    agent.open = False
    code, out, _ = await run_hook(argv, JOB_AD, hook_env(**{GATE_ENV: str(server.path)}))
    assert code == 0
    assert out.splitlines() == [
        f"HookStatusCode = {GATE_CLOSED_STATUS}",
        'HookStatusMessage = "drone is draining"',
    ]
    reply = parse_ad(out)
    assert reply.integer("HookStatusCode") == GATE_CLOSED_STATUS


async def test_prepare_job_without_an_agent_refuses_with_391(tmp_path: Path) -> None:
    env = hook_env(**{GATE_ENV: str(tmp_path / "gone.sock")})
    code, out, err = await run_hook([*MODULE, "prepare-job"], JOB_AD, env)
    assert code == 0
    reply = parse_ad(out)
    assert reply.integer("HookStatusCode") == AGENT_UNREACHABLE_STATUS
    assert "unreachable" in (reply.string("HookStatusMessage") or "")
    assert "cannot ask the agent" in err


async def test_prepare_job_with_a_stale_socket_refuses_with_391(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    code, out, _ = await run_hook(
        [*MODULE, "prepare-job"], JOB_AD, hook_env(**{GATE_ENV: str(path)})
    )
    assert code == 0
    assert parse_ad(out).integer("HookStatusCode") == AGENT_UNREACHABLE_STATUS


async def test_prepare_job_with_a_hung_agent_gives_up_in_bounded_time(tmp_path: Path) -> None:
    path = tmp_path / "hung.sock"
    connections: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # accept, read nothing, answer nothing

    server = await asyncio.start_unix_server(never_answer, path=str(path))
    try:
        # a bound, not a speed: the 1 s timeout ends the wait long before 30 s
        code, out, _ = await run_hook(
            [*MODULE, "prepare-job", "--timeout", "1"],
            JOB_AD,
            hook_env(**{GATE_ENV: str(path)}),
            timeout_s=30,
        )
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()
    assert code == 0
    assert parse_ad(out).integer("HookStatusCode") == AGENT_UNREACHABLE_STATUS
    assert len(connections) == 1


async def test_prepare_job_without_a_gate_in_its_environment_refuses(
    gate: tuple[GateServer, FakeAgent],
) -> None:
    _, agent = gate
    # no COBALD_REMOTE_GATE and no shared fallback directory: benign refusal, nothing asked
    code, out, _ = await run_hook([DEPLOY_DIR / "hook-prepare-job"], JOB_AD, hook_env())
    assert code == 0
    assert parse_ad(out).integer("HookStatusCode") == AGENT_UNREACHABLE_STATUS
    assert agent.started == []


async def test_prepare_job_with_garbage_on_stdin_still_asks(
    gate: tuple[GateServer, FakeAgent],
) -> None:
    server, agent = gate
    garbage = b"\x00\xff not a job ad\n= = =\n" * 100
    code, out, _ = await run_hook(
        [*MODULE, "prepare-job"], garbage, hook_env(**{GATE_ENV: str(server.path)})
    )
    assert (code, out) == (0, "")
    assert [job.job_id for job in agent.started] == ["unknown"]


@pytest.mark.parametrize(
    ("reason", "how"),
    [("exit", PayloadEnd.EXIT), ("evict", PayloadEnd.EVICT), ("vanished", PayloadEnd.UNKNOWN)],
)
async def test_job_exit_reports_and_exits_0(
    gate: tuple[GateServer, FakeAgent], reason: str, how: PayloadEnd
) -> None:
    server, agent = gate
    ad = JOB_AD + b"ExitBySignal = false\nExitCode = 3\nJobDuration = 61.25\n"
    code, out, _ = await run_hook(
        [DEPLOY_DIR / "hook-job-exit", reason], ad, hook_env(**{GATE_ENV: str(server.path)})
    )
    assert (code, out) == (0, "")
    assert agent.exited == [("4711.2", how, 3, 61.25)]


async def test_job_exit_by_signal_reports_a_negative_code(
    gate: tuple[GateServer, FakeAgent],
) -> None:
    server, agent = gate
    ad = JOB_AD + b"ExitBySignal = true\nExitSignal = 9\nJobDuration = 5\n"
    code, _, _ = await run_hook(
        [*AGENT_HOOK, "job-exit", "evict"], ad, hook_env(**{GATE_ENV: str(server.path)})
    )
    assert code == 0
    assert agent.exited == [("4711.2", PayloadEnd.EVICT, -9, 5.0)]


async def test_job_exit_without_an_agent_still_exits_0(tmp_path: Path) -> None:
    env = hook_env(**{GATE_ENV: str(tmp_path / "gone.sock")})
    code, out, err = await run_hook([*MODULE, "job-exit", "exit"], JOB_AD, env)
    assert (code, out) == (0, "")
    assert "not reported" in err
