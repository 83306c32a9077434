"""
The local HTCondor startd, asked through its command-line tools (``docs/htcondor.md``)

:class:`CondorStartd` is the only code in the agent that runs ``condor_*`` executables;
it finds them on ``PATH`` and talks only to the daemons of this drone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from remote_agent.classad import ClassAd, parse_ads
from remote_agent.errors import StartdError
from remote_agent.interfaces import DrainResult, SlotInfo

log = logging.getLogger(__name__)

#: the machine attribute that the drone's ``START`` expression requires to be ``True``
GATE_ATTRIBUTE: Final = "DroneGateOpen"
#: what the master's readiness ad must say about the startd
READY_EXPRESSION: Final = 'STARTD_State =?= "Ready"'
#: condor_drain refusals (``src/condor_includes/condor_error_codes.h``)
DRAINING_ALREADY_IN_PROGRESS: Final = 10001
DRAINING_NO_MATCHING_REQUEST_ID: Final = 10002
DRAINING_CHECK_EXPR_FAILED: Final = 10003

_ERROR_CODE_RE = re.compile(r"error code (\d+)")
_REFUSALS = {
    DRAINING_ALREADY_IN_PROGRESS: "the startd is already draining",
    DRAINING_NO_MATCHING_REQUEST_ID: "no matching drain request",
    DRAINING_CHECK_EXPR_FAILED: "the drain check expression is not true on every slot",
}


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill ``proc`` and wait for it, even while the calling task is being cancelled"""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(asyncio.CancelledError):
        await proc.wait()


class _UsageError(Exception):
    """A tool said its arguments were wrong (exit 2): a bug in this module"""


@dataclass(frozen=True, slots=True)
class _Run:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def said(self) -> str:
        """The tool's own words, on one line"""
        return " ".join((self.stderr.strip() or self.stdout.strip()).split()) or "(no output)"


class CondorStartd:
    """
    The startd of this drone, through ``condor_who``, ``condor_update_machine_ad``
    and ``condor_drain``

    :param timeout_s: limit for each tool run, in seconds; a tool still running
        then is killed
    :param env: environment of the tools (default: the agent's own)
    """

    def __init__(
        self,
        *,
        gate_attribute: str = GATE_ATTRIBUTE,
        timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.gate_attribute = gate_attribute
        self.timeout_s = timeout_s
        self.env = dict(env) if env is not None else None
        self._address: str | None = None  #: the startd's sinful string, from the master
        self._pid: int | None = None  #: the startd's PID, from the master
        self._accepting: bool | None = None  #: what set_accepting was last asked
        self._applied_pid: int | None = None  #: the startd PID that last got it

    async def _run(self, *argv: str, stdin: bytes | None = None) -> _Run:
        """
        Run one tool to completion

        :raises StartdError: the tool is not installed or did not finish in time
        """
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env,
            )
        except OSError as err:
            raise StartdError(f"cannot run {argv[0]}: {err}") from err
        try:
            async with asyncio.timeout(self.timeout_s):
                out, errout = await proc.communicate(stdin)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise StartdError(f"{argv[0]} did not finish within {self.timeout_s:g}s") from None
        except asyncio.CancelledError:
            # the agent stopped asking (it winds down): the tool does not outlive the call
            await _reap(proc)
            raise
        result = _Run(
            argv=argv,
            returncode=proc.returncode if proc.returncode is not None else -1,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=errout.decode("utf-8", errors="replace"),
        )
        log.debug("%s exited %d", " ".join(argv), result.returncode)
        return result

    # ------------------------------------------------------------------ observation

    async def _readiness(self) -> ClassAd | None:
        """The master's readiness ad, or ``None`` if no master answered"""
        try:
            run = await self._run("condor_who", "-wait-for-ready:0", READY_EXPRESSION)
        except StartdError as err:
            log.warning("readiness query failed: %s", err)
            return None
        if run.returncode != 0:
            log.info("condor_who -wait-for-ready failed (exit %d): %s", run.returncode, run.said())
            return None
        for ad in parse_ads(run.stdout):
            if "IsReady" in ad or "STARTD" in ad or "MASTER" in ad:
                return ad
        return None

    async def ready(self) -> bool:
        """
        Whether the master reports the startd alive and ready

        Also remembers the startd's address (the target of ``condor_drain``)
        and re-applies the gate attribute if the startd was restarted since
        :meth:`set_accepting` (its machine ad extras are lost then).
        """
        ad = await self._readiness()
        if ad is None:
            return False
        pid = ad.integer("STARTD_PID")
        alive = ad.string("STARTD") in (None, "Alive")
        ready = ad.string("STARTD_State") == "Ready" and alive and (pid is None or pid > 0)
        if not ready:
            return False
        self._address = ad.string("STARTD_Addr") or self._address
        self._pid = pid
        if self._accepting is not None and pid is not None and pid != self._applied_pid:
            log.warning(
                "startd restarted (pid %s, was %s); setting %s again",
                pid,
                self._applied_pid,
                self.gate_attribute,
            )
            try:
                await self.set_accepting(self._accepting)
            except StartdError as err:
                log.warning("cannot restore %s: %s", self.gate_attribute, err)
        return True

    async def _slot_ads(self) -> list[ClassAd]:
        run = await self._run("condor_who", "-long")
        if run.returncode != 0:
            raise StartdError(f"condor_who -long failed (exit {run.returncode}): {run.said()}")
        return [ad for ad in parse_ads(run.stdout) if ad.string("Name")]

    async def slots(self) -> list[SlotInfo]:
        """
        The slots that run a job, as ``condor_who -long`` lists them

        ``condor_who`` shows only slots with a ``JobId``; an empty list means
        that nothing runs (or that no startd is up: ask :meth:`ready`).

        :raises StartdError: ``condor_who`` failed to query the startd
        """
        return sorted(
            (
                SlotInfo(
                    name=ad.string("Name") or "",
                    state=ad.string("State") or "",
                    activity=ad.string("Activity") or "",
                    job_id=ad.string("JobId") or None,
                )
                for ad in await self._slot_ads()
            ),
            key=lambda slot: slot.name,
        )

    # ------------------------------------------------------------------ control

    async def set_accepting(self, accepting: bool) -> None:
        """
        Set the gate attribute that ``START`` requires on the local startd

        :raises StartdError: ``condor_update_machine_ad`` failed
        """
        if self._pid is None:
            await self.ready()  # learn which startd gets it, to notice a restart later
        value = "True" if accepting else "False"
        # the tool reads one ad up to a blank line; without it the ad is "unexpectedly ended"
        update = f"{self.gate_attribute} = {value}\n\n".encode()
        run = await self._run("condor_update_machine_ad", stdin=update)
        if run.returncode != 0:
            raise StartdError(
                f"condor_update_machine_ad {self.gate_attribute} = {value} failed"
                f" (exit {run.returncode}): {run.said()}"
            )
        self._accepting = accepting
        self._applied_pid = self._pid
        log.info("startd %s = %s", self.gate_attribute, value)

    async def _target(self) -> str | None:
        """The startd's current address (it changes when the startd restarts)"""
        return self._address if await self.ready() else None

    async def drain(self, reason: str, *, fast: bool = False) -> DrainResult:
        """
        ``condor_drain -graceful|-fast -exit-on-completion`` on the local startd

        Exit 0: accepted (not finished). Exit 1 is ambiguous, so the slots are
        read again to say why. Exit 2 means the arguments were wrong: a bug here.
        A fast drain that finds a graceful one in progress cancels it and drains
        fast (the gate attribute keeps ``START`` false in between).

        :raises StartdError: ``condor_drain`` rejected its arguments (exit 2)
        """
        target = await self._target()
        if target is None:
            return DrainResult(accepted=False, detail="the startd is not running")
        try:
            run = self._usage_checked(await self._drain(target, reason, fast))
            code = self._error_code(run)
            if run.returncode != 0 and code == DRAINING_ALREADY_IN_PROGRESS and fast:
                log.warning("a graceful drain is in progress; cancelling it to drain fast")
                cancel = self._usage_checked(await self._run("condor_drain", "-cancel", target))
                if cancel.returncode == 0:
                    run = self._usage_checked(await self._drain(target, reason, fast))
                    code = self._error_code(run)
                    if run.returncode == 0:
                        return DrainResult(
                            accepted=True, detail=f"graceful drain cancelled; {run.said()}"
                        )
        except _UsageError as err:
            raise StartdError(str(err)) from None
        except StartdError as err:  # not installed, or hanging
            return DrainResult(accepted=False, detail=f"{err}; {await self._explain()}")
        if run.returncode == 0:
            return DrainResult(accepted=True, detail=run.said())
        why = _REFUSALS.get(code, "") if code is not None else ""
        detail = f"{why}: {run.said()}" if why else f"condor_drain failed: {run.said()}"
        return DrainResult(accepted=False, detail=f"{detail}; {await self._explain()}")

    async def _drain(self, target: str, reason: str, fast: bool) -> _Run:
        return await self._run(
            "condor_drain",
            "-fast" if fast else "-graceful",
            "-exit-on-completion",
            "-reason",
            reason,
            target,
        )

    @staticmethod
    def _usage_checked(run: _Run) -> _Run:
        if run.returncode == 2:
            raise _UsageError(f"{' '.join(run.argv[:2])} rejected its arguments: {run.said()}")
        return run

    @staticmethod
    def _error_code(run: _Run) -> int | None:
        match = _ERROR_CODE_RE.search(run.stderr)
        return int(match.group(1)) if match else None

    async def _explain(self) -> str:
        """What the startd looks like now, to say why a drain was not accepted"""
        if not await self.ready():
            return "the startd is not running"
        try:
            ads = await self._slot_ads()
        except StartdError as err:
            return f"the startd is up, but its slots cannot be read: {err}"
        if not ads:
            return "the startd is up and no slot runs a job"
        draining = [ad for ad in ads if ad.boolean("Draining")]
        busy = ", ".join(
            f"{ad.string('Name')} {ad.string('State')}/{ad.string('Activity')} {ad.string('JobId')}"
            for ad in ads
        )
        prefix = "the startd is draining; " if draining else ""
        return f"{prefix}{len(ads)} slot(s) run jobs: {busy}"
