"""
The narrow seams inside the agent: the startd it supervises and the gate's handler

:class:`GateHandler` decisions are synchronous on purpose: they run in the agent's event
loop without awaiting, so a payload start and a drain never interleave. Only the reply
waits, until what a decision recorded is on disk (:meth:`GateHandler.settled`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from remote_agent.protocol.events import PayloadEnd

#: slot States that are not busy when no job is listed there (HTCondor ``State``)
IDLE_SLOT_STATES = frozenset({"Unclaimed", "Owner", "Drained"})


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One slot of the local startd as ``condor_who -long`` reports it"""

    name: str  #: e.g. ``slot1_1@wn042.example.org``
    state: str  #: HTCondor slot State, e.g. ``Unclaimed``, ``Claimed``, ``Drained``
    activity: str  #: HTCondor slot Activity, e.g. ``Idle``, ``Busy``, ``Retiring``
    job_id: str | None = None  #: ``<cluster>.<proc>`` of the job running there, if any

    @property
    def busy(self) -> bool:
        """
        Whether this slot keeps the drone from being idle

        A slot is busy if a job is listed there, or if its State is anything but
        ``Unclaimed``, ``Owner`` or ``Drained``: a ``Claimed`` slot whose job has
        not started yet (input transfer, PREPARE_JOB pending), ``Matched``,
        ``Preempting``, ``Backfill``, or a State this code does not know.
        """
        return self.job_id is not None or self.state not in IDLE_SLOT_STATES


@dataclass(frozen=True, slots=True)
class DrainResult:
    """What ``condor_drain`` on the local startd did"""

    accepted: bool  #: exit 0: the startd accepted the request (not: finished it)
    detail: str = ""  #: why not, from the tool's output and the slot ads


class Startd(Protocol):
    """What the agent needs from the startd it supervises"""

    async def ready(self) -> bool:
        """Whether the startd answers locally (``condor_who`` succeeds and lists slots)"""
        ...

    async def slots(self) -> list[SlotInfo]:
        """
        The startd's slots that are claimed or run a job, asked locally (no
        central manager involved); an empty list means that nothing is claimed
        and nothing runs. The agent calls the drone idle only on an empty list
        (or on slots that are all :attr:`SlotInfo.busy` false).

        :raises StartdError: if the startd does not answer
        """
        ...

    async def set_accepting(self, accepting: bool) -> None:
        """
        Flip the local attribute used in ``START`` so no new claims arrive (or again may)

        :raises StartdError: if the attribute could not be set
        """
        ...

    async def drain(self, reason: str, *, fast: bool = False) -> DrainResult:
        """
        Ask the local startd to drain and exit on completion (``condor_drain``)

        ``fast=False`` is ``-graceful`` (payloads run to completion within
        ``MaxJobRetirementTime``); ``fast=True`` is ``-fast`` (hard kill), used
        only by the ``kill`` deadline policy.
        """
        ...


@dataclass(frozen=True, slots=True)
class JobStart:
    """A payload about to start, from the job ad the starter passes to PREPARE_JOB"""

    job_id: str  #: ``<ClusterId>.<ProcId>``
    slot: str = ""
    owner: str = ""
    #: the runtime its job ad requests or expects, in seconds (``None``: it gives none)
    requested_s: float | None = None


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The agent's answer to PREPARE_JOB"""

    allow: bool
    #: for a refusal: printed as ``HookStatusCode`` (3xx: the job goes back to idle)
    status_code: int = 0
    message: str = ""


#: the refusal code of a closed gate: >= 300 sends the job back to idle, never on hold
GATE_CLOSED_STATUS = 390
#: the refusal code the hook uses when it cannot reach the agent at all
AGENT_UNREACHABLE_STATUS = 391
#: the refusal code of a payload that cannot finish before the drone's end
END_REFUSED_STATUS = 392

#: how a ``condor_master`` ends once its startd drained with ``-exit-on-completion``:
#: 0, or 99 when ``DAEMON_SHUTDOWN`` fired; either is the planned end of a drone
SELF_EXIT_STATUSES = frozenset({0, 99})


class GateHandler(Protocol):
    """The agent, as the gate socket sees it; each decision is synchronous (see module doc)"""

    def prepare_job(self, job: JobStart) -> GateDecision:
        """Allow (and record as started) or refuse one payload"""
        ...

    def job_exited(
        self, job_id: str, how: PayloadEnd, exit_code: int | None, duration_s: float | None
    ) -> None:
        """Record that a payload ended (JOB_EXIT hook)"""
        ...

    async def settled(self) -> None:
        """Return once what the calls so far recorded is on disk; the gate replies after it"""
        ...
