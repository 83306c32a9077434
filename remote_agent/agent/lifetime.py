"""
The drone's end: learned from its batch system, moved up by a notice, kept by the gate and the drain

The end (:attr:`DroneStatus.end_at`) is a point on the agent's monotonic clock: the earliest
of what the batch system says (Slurm's end time, an HTCondor job's limits), of the walltime
(``--walltime``, else TARDIS's ``$SLURM_Walltime``) from the agent's start and, once the
batch system announces the end by a signal, of the notice plus its grace (``--term-grace``
for SIGTERM, ``--warning-grace`` for SIGUSR1 and SIGUSR2). It only
ever moves up. An absolute time is turned into a span on the node's clock the moment it is
read (:mod:`remote_agent.batchsystem`): the drone's wall clock decides nothing later.

With the drain point ``D`` ``--end-margin`` seconds before the end:

- the gate lets a payload in only if it ends by ``D``, by the runtime its job ad gives
  (else ``--payload-runtime``) (:meth:`DroneStatus.end_refusal`);
- at ``D`` minus ``--payload-runtime``, or at once on a notice, the drone drains itself by
  ``D`` (:meth:`Drain.end_drain`): the gate shuts, payloads that end by ``D`` finish, the
  rest are vacated at ``D`` and the worker ends before the batch system kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from remote_agent.agent.context import AgentContext
from remote_agent.agent.drain import Drain
from remote_agent.batchsystem import EndUnknown, condor_job_limit, slurm_end, span_until

log = logging.getLogger("remote_agent.agent")

#: the signals by which a batch system announces a drone's end (SIGINT stops the agent at once)
NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Lifetime:
    """
    Learns the drone's end, moves it up on a notice, drains the drone in time for it

    :param started: when the agent started, on the monotonic clock: the walltime counts
        from there
    """

    def __init__(self, context: AgentContext, drain: Drain, started: float) -> None:
        self._context = context
        self._drain = drain
        self._started = started
        #: set once the batch system was asked (whatever it said): the gate may open
        self.known = asyncio.Event()
        self._changed = asyncio.Event()

    async def learn(self) -> None:
        """Ask the batch system and the settings for the end; set :attr:`known` either way"""
        try:
            for span, source in await self._spans():
                self._move_up(time.monotonic() + span, source)
        finally:
            self.known.set()
        status = self._context.status
        left = status.end_left_s()
        if left is not None:
            log.info(
                "the drone's batch job ends in %.0fs (%s)",
                left,
                status.end_source,
                extra=self._context.extra,
            )

    async def _spans(self) -> list[tuple[float, str]]:
        """Seconds from now to the end, by each source that says it"""
        settings, batch = self._context.settings, self._context.settings.batch
        spans: list[tuple[float, str]] = []
        try:
            if batch.slurm_end_time is not None:
                spans.append((span_until(batch.slurm_end_time), "SLURM_JOB_END_TIME"))
            elif batch.slurm_job_id is not None:
                spans.append((span_until(await slurm_end(batch.slurm_job_id)), "squeue"))
        except EndUnknown as err:
            log.warning("Slurm does not tell the job's end: %s", err, extra=self._context.extra)
        ran = time.monotonic() - self._started
        if batch.condor_job_ad is not None:
            try:
                spans.append((condor_job_limit(batch.condor_job_ad) - ran, "job ad"))
            except EndUnknown as err:
                log.debug("no end from the job ad: %s", err, extra=self._context.extra)
        if settings.walltime_s is not None:
            spans.append((settings.walltime_s - ran, "walltime"))
        return spans

    def _move_up(self, end: float, source: str) -> bool:
        """Take ``end`` (monotonic) for the drone's end if it is sooner than the one known"""
        status = self._context.status
        if status.end_at is not None and end >= status.end_at:
            return False
        status.end_at, status.end_source = end, source
        self._changed.set()
        return True

    def notice(self, signum: int) -> None:
        """
        The batch system announces the end by ``signum``: it is now plus the grace, at the
        latest; the gate shuts at once and the drone drains by the drain point
        """
        context, status = self._context, self._context.status
        name = signal.Signals(signum).name
        settings = context.settings
        grace = settings.term_grace_s if signum == signal.SIGTERM else settings.warning_grace_s
        context.counters["end_notices"] += 1
        self._move_up(time.monotonic() + grace, "notice")
        status.end_notice = name
        left = status.end_left_s()
        assert status.end_at is not None and left is not None
        log.warning(
            "received %s: the batch system ends the drone in %.0fs at the latest; gate closed,"
            " payloads that end %.0fs before it finish, the rest are vacated",
            name,
            left,
            context.settings.end_margin_s,
            extra=context.extra,
        )
        self._drain.end_drain(
            status.end_at - context.settings.end_margin_s,
            f"end notice ({name}): the batch system ends the drone in {max(0.0, left):.0f}s",
        )

    def worker_started(self) -> None:
        """The worker runs: a drain the end called for before can start now"""
        self._changed.set()

    async def keep(self) -> None:
        """Drain the drone in time for its end: at the drain point minus the payload runtime"""
        context, status = self._context, self._context.status
        await self.known.wait()
        while not status.winding_down:
            self._changed.clear()
            wait: float | None = None
            if status.end_at is not None:
                drain_point = status.end_at - context.settings.end_margin_s
                wait = drain_point - context.settings.payload_runtime_s - time.monotonic()
                if wait <= 0:
                    left = max(0.0, status.end_at - time.monotonic())
                    self._drain.end_drain(
                        drain_point,
                        f"the drone's end: its batch job ends in {left:.0f}s ({status.end_source})",
                    )
                    # from now on only a sooner end (a notice) matters; or, if the worker
                    # had not started, its start (:meth:`worker_started`)
                    wait = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)
