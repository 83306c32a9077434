"""Processes and ports of the tests: launching commands, whether a PID lives, free ports"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import IO, Any

from broker.emulation.ports import free_ports

__all__ = ["CLI", "free_ports", "pid_exists", "run_process", "start_process"]


def pid_exists(pid: int) -> bool:
    """Whether a process with ``pid`` is still around (tests check we stopped ours)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: ``cobald-remote`` as this interpreter runs it (no installed console script needed)
CLI = (sys.executable, "-m", "broker.cli")


async def start_process(
    *argv: str | Path,
    stdin: int | IO[Any] | None = asyncio.subprocess.DEVNULL,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    **options: Any,
) -> asyncio.subprocess.Process:
    """
    Start ``argv`` (e.g. ``*CLI, "agent", "run", ...``); the caller waits for it or stops it

    Its output goes where the test's goes unless ``stdout``/``stderr`` say otherwise:
    a pipe nobody reads would stall a chatty process. ``options`` go to
    :func:`asyncio.create_subprocess_exec` (``env``, ``cwd``, ...).
    """
    return await asyncio.create_subprocess_exec(
        *argv, stdin=stdin, stdout=stdout, stderr=stderr, **options
    )


async def run_process(
    *argv: str | Path, input: bytes | None = None, timeout_s: float = 60.0, **options: Any
) -> tuple[int, str, str]:
    """
    Run ``argv`` to its end, fed ``input``; its exit code, stdout and stderr

    :raises AssertionError: if it has not ended within ``timeout_s`` (it is killed)
    """
    proc = await start_process(
        *argv,
        stdin=asyncio.subprocess.DEVNULL if input is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        **options,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(input), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        command = " ".join(str(arg) for arg in argv)
        raise AssertionError(f"{command} did not end within {timeout_s:.0f}s") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
