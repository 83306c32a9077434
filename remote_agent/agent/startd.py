"""
The local startd, watched and steered: readiness, its slots, START, ``condor_drain``

The startd is the authority on "idle", the hooks only a hint: a drone counts
as idle only when the startd lists nothing busy.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from remote_agent.agent.bounds import cut
from remote_agent.agent.context import AgentContext
from remote_agent.agent.payloads import PayloadLedger
from remote_agent.errors import StartdError
from remote_agent.interfaces import SlotInfo, Startd
from remote_agent.protocol.events import DroneState, StartdReady
from remote_agent.protocol.fields import MAX_NAME
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("remote_agent.agent")
_rejections = RateLimitedLog(log)

S = DroneState

#: seconds between readiness checks of a startd that is up
_READY_CHECK_S = 30.0
#: seconds at least between two listings that confirm JOB_EXIT reports: a flood of
#: reports costs one listing a second
_CONFIRM_GAP_S = 1.0


class StartdObserver:
    """
    What the agent knows of and asks of the startd; ``startd`` ``None``: ``--no-startd``

    :param claimable: set once the startd is ready: the handshake claim may start
    """

    def __init__(
        self,
        context: AgentContext,
        startd: Startd | None,
        ledger: PayloadLedger,
        claimable: asyncio.Event,
    ) -> None:
        self._context = context
        self.startd = startd
        self._ledger = ledger
        self._claimable = claimable
        self.ready = False
        #: busy slots at the last look at the startd (-1: it did not answer)
        self.busy_slots = 0
        #: the startd accepted a drain with exit on completion: it ends the worker when empty
        self.exits_when_empty = False
        #: the START attribute as last set (``None``: never set)
        self._accepting: bool | None = None
        self._accepting_lock = asyncio.Lock()
        #: a listing that confirms JOB_EXIT reports runs, and another one is due after it
        self._confirming = False
        self._confirm_again = False
        if startd is not None:
            ledger.confirm = self.confirm_exits

    async def observe(self) -> None:
        """Poll the startd: readiness first, then its slots as a backstop to the hooks"""
        assert self.startd is not None
        failures = polls = 0
        # after the startd came up, ask for readiness now and then too: that is where
        # CondorStartd notices a restarted startd and sets the gate attribute again
        ready_every = max(1, round(_READY_CHECK_S / self._context.settings.poll_s))
        while not self._context.status.winding_down:
            try:
                if not self.ready:
                    if await self.startd.ready():
                        self._on_ready(await self.startd.slots())
                else:
                    polls += 1
                    if polls % ready_every == 0:
                        await self.startd.ready()
                    self._reconcile(await self.startd.slots())
                failures = 0
            except StartdError as err:
                failures += 1
                log.log(
                    logging.WARNING if failures == 3 else logging.DEBUG,
                    "the startd does not answer: %s",
                    err,
                    extra=self._context.extra,
                )
            await asyncio.sleep(self._context.settings.poll_s)

    def _on_ready(self, slots: list[SlotInfo]) -> None:
        self.ready = True
        self._context.status.slots = max(len(slots), self._context.settings.slots)
        if self._context.status.state is S.WORKER_UP:
            self._context.status.move(S.STARTD_READY)
        name = slots[0].name if slots else socket.gethostname()
        self._context.emitter.emit(
            StartdReady, slots=self._context.status.slots, name=cut(name, MAX_NAME)
        )
        # The gate has never been open in this incarnation (the claim waits for this
        # moment), so whatever runs now was let in before: an agent that was restarted.
        self._ledger.adopt_unknown(slots, "was running when the agent started")
        self._claimable.set()

    def confirm_exits(self) -> None:
        """
        A payload was reported ended: list the slots now, to see whether the startd agrees

        One listing at a time, at most one a :data:`_CONFIRM_GAP_S`; reports that come
        meanwhile are confirmed by the next one. A listing that fails leaves the reports
        to the next poll.
        """
        if self._context.status.winding_down:
            return  # nothing new starts; the worker's end finishes every payload
        if self._confirming:
            self._confirm_again = True
            return
        self._confirming = True
        self._context.tasks.spawn(self._confirm(), "startd-confirm-exits")

    async def _confirm(self) -> None:
        assert self.startd is not None
        try:
            while True:
                self._confirm_again = False
                try:
                    slots = await self.startd.slots()
                except StartdError as err:
                    log.debug("cannot confirm job exits now: %s", err, extra=self._context.extra)
                    return
                self._ledger.confirm_exits(slots)
                if not self._confirm_again:
                    return
                await asyncio.sleep(_CONFIRM_GAP_S)
        finally:
            self._confirming = False

    def _reconcile(self, slots: list[SlotInfo]) -> None:
        self._context.status.slots = max(len(slots), self._context.settings.slots)
        self._ledger.reconcile(slots)

    async def busy(self) -> list[SlotInfo] | None:
        """
        The slots the startd reports busy (claimed, or running a job); ``None``: unknown

        A startd that does not answer while the worker runs is *not* idle
        (``None``); an exited worker took its startd and payloads with it (``[]``).
        """
        if self.startd is None:
            return []
        try:
            slots = await self.startd.slots()
        except StartdError as err:
            if self._context.status.worker_ended:
                return []
            _rejections.log(
                logging.INFO,
                "startd_unanswered",
                "the startd does not answer (%s); not calling the drone idle",
                err,
                extra=self._context.extra,
            )
            return None
        busy = [slot for slot in slots if slot.busy]
        self._ledger.adopt_unknown(slots, "still listed by the startd")
        return busy

    async def confirm_idle(self) -> bool:
        """
        Before saying "drained": nothing in the snapshot, and the startd lists nothing busy

        A startd that does not answer any more while the worker runs may be
        hanging: not idle. Once the worker has exited (drain with exit on
        completion), its payloads have ended with it.
        """
        busy = await self.busy()
        self.busy_slots = -1 if busy is None else len(busy)
        return busy is not None and not busy and not self._context.status.payloads

    def sync_accepting(self) -> None:
        """Make the startd's START attribute follow the gate (in order, last wins)"""
        if self.startd is not None:
            self._context.tasks.spawn(self._apply_accepting(), "startd-accepting")

    async def _apply_accepting(self) -> None:
        assert self.startd is not None
        async with self._accepting_lock:
            wanted = self._context.status.gate_open
            if wanted == self._accepting:
                return
            try:
                await self.startd.set_accepting(wanted)
            except StartdError as err:
                log.warning(
                    "cannot set the startd's START attribute to %s: %s; the gate hook "
                    "still refuses payloads",
                    wanted,
                    err,
                    extra=self._context.extra,
                )
                return
            self._accepting = wanted

    async def stop(self, reason: str) -> None:
        """No new claims, and drain the startd gracefully so it exits on completion"""
        if self.startd is None:
            return
        await self._apply_accepting()
        await self.drain(reason, fast=False)

    async def drain(self, reason: str, *, fast: bool) -> bool:
        """``condor_drain`` the startd (``fast``: ``-fast``, else ``-graceful``); accepted?"""
        assert self.startd is not None
        try:
            result = await self.startd.drain(reason or "cobald-remote drain", fast=fast)
        except StartdError as err:
            log.warning("condor_drain failed: %s", err, extra=self._context.extra)
            return False
        if not result.accepted:
            log.warning("condor_drain refused: %s", result.detail, extra=self._context.extra)
            return False
        self.exits_when_empty = True
        return True
