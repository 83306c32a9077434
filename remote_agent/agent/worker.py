"""The worker process (normally ``condor_master -f``): start, signals, end, kill, exit status"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Sequence

from remote_agent.agent.context import AgentContext
from remote_agent.agent.status import DroneStatus
from remote_agent.interfaces import SELF_EXIT_STATUSES
from remote_agent.settings import SECRET_ENV

log = logging.getLogger("remote_agent.agent")


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` for signal ``N``"""
    return returncode if returncode >= 0 else 128 - returncode


class Worker:
    """
    Supervises the worker; the process is :attr:`DroneStatus.worker`

    :param env: extra environment of the worker, e.g. where the gate socket is
    """

    def __init__(self, context: AgentContext, *, env: dict[str, str]) -> None:
        self._context = context
        self.env = env

    async def start(self, command: Sequence[str]) -> asyncio.subprocess.Process:
        """
        Start the worker in its own process group

        :raises OSError: if it cannot be started
        """
        # the bootstrap token is the agent's alone: the startd and its payloads do not get it
        inherited = {key: value for key, value in os.environ.items() if key not in SECRET_ENV}
        worker = await asyncio.create_subprocess_exec(
            *command,
            env={**inherited, **self.env},
            stdin=asyncio.subprocess.DEVNULL,
            # its own process group: a Ctrl-C reaches it once, through the agent
            start_new_session=True,
        )
        self._context.status.worker = worker
        return worker

    def forward(self, signum: int) -> None:
        """Pass ``signum`` on to the worker, if it runs"""
        worker = self._context.status.worker
        if worker is not None and worker.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.send_signal(signum)

    async def end_job(self, reason: str, *, exits_itself: bool = False) -> None:
        """
        End the drone's batch job: the worker ends by itself or is terminated

        :param exits_itself: the startd accepted a drain with exit on completion: the worker
            gets ``end_grace_s`` to follow, but no longer than leaves ``kill_after_s`` before
            the drone's end; otherwise nothing would end it, and it is terminated at once
        """
        status, settings = self._context.status, self._context.settings
        status.ending = reason
        worker = status.worker
        if worker is None or worker.returncode is not None:
            return
        grace = settings.end_grace_s
        left = status.end_left_s()
        if left is not None:
            grace = min(grace, max(0.0, left - settings.kill_after_s))
        if exits_itself:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.wait(), grace)
        if worker.returncode is None:
            log.info("ending the worker (%s)", reason, extra=self._context.extra)
            await self.terminate()

    async def terminate(self) -> None:
        """SIGTERM, then SIGKILL to its process group after ``kill_after_s``"""
        worker = self._context.status.worker
        if worker is None or worker.returncode is not None:
            return
        self._context.status.terminated = True
        with contextlib.suppress(ProcessLookupError):
            worker.terminate()
        try:
            await asyncio.wait_for(worker.wait(), self._context.settings.kill_after_s)
        except TimeoutError:
            log.warning(
                "worker %d ignored SIGTERM for %.0fs, killing it",
                worker.pid,
                self._context.settings.kill_after_s,
                extra=self._context.extra,
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)

    async def kill(self) -> None:
        """The agent itself is failing: do not leave the worker behind"""
        worker = self._context.status.worker
        if worker is None or worker.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(worker.wait()), 5)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)


def exit_decision(status: DroneStatus, worker_status: int) -> tuple[int, str]:
    """The agent's exit code and its reason, once the worker ended with ``worker_status``"""
    if status.ending is not None and (status.terminated or worker_status in SELF_EXIT_STATUSES):
        # the drone ended its own job as planned (drained or released)
        return 0, status.ending
    if status.ending is not None:
        return worker_status, status.ending
    if status.stop_signal is not None:
        return worker_status, f"{signal.Signals(status.stop_signal).name} from the batch system"
    return worker_status, "the worker exited"
