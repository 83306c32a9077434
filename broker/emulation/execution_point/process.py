"""Running the fake ``condor_master -f`` as a child process (for tests and the demo)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from broker.emulation.execution_point.config import Config
from broker.emulation.execution_point.control import EmulatorControl


class EmulatedMaster:
    """
    ``async with EmulatedMaster(env) as ep:`` starts ``condor_master -f`` from the
    ``PATH`` in ``env`` (see :func:`~broker.emulation.execution_point.install_fake_condor`),
    waits until its startd is ready, and on exit stops it by its PID (SIGQUIT, then SIGKILL)

    ``ep`` is an :class:`~broker.emulation.execution_point.EmulatorControl`;
    :attr:`process` is the master.
    """

    def __init__(self, env: Mapping[str, str], *, ready_timeout_s: float = 60.0) -> None:
        self.env = dict(env)
        config = Config.load(Path(self.env["CONDOR_CONFIG"]), self.env)
        self.state_dir = Path(config.get("EMULATOR_STATE_DIR") or ".")
        self.control = EmulatorControl(self.state_dir)
        self.ready_timeout_s = ready_timeout_s
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> EmulatorControl:
        self.process = await asyncio.create_subprocess_exec(
            "condor_master", "-f", env=self.env, stdin=asyncio.subprocess.DEVNULL
        )
        await self.control.wait_ready(self.ready_timeout_s)
        return self.control

    async def wait(self, timeout_s: float = 60.0) -> int:
        """
        The master's exit code, once it has exited by itself

        :raises TimeoutError: it still runs after ``timeout_s``
        """
        assert self.process is not None
        async with asyncio.timeout(timeout_s):
            return await self.process.wait()

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        if self.process.returncode is None:
            os.kill(self.process.pid, sig)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the master (fast shutdown, then kill) unless it has exited already"""
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGQUIT)
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def __aenter__(self) -> EmulatorControl:
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
