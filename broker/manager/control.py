"""
The manager's control API: release, drain, release-if-idle, status, and may-remove

Every operation that can end a drone goes through the handshake record first
(:class:`remote_agent.protocol.handshake.RecordStore`), so that its effect does not
depend on a message arriving: the request-reply command to the agent only
makes it fast. The answers are enums and frozen dataclasses that say what
actually happened, for TARDIS and for operators.

:func:`removal_verdict` is the only place that says a drone's batch job may be
removed (``condor_rm``, ``scancel``, ...). It answers yes in exactly the four
safe cases of the design (``docs/architecture.md``, "Control API"):

a. the manager released the drone before its agent came up (record ``released``
   with the manager's proof, :func:`remote_agent.protocol.handshake.record_proof`: no
   payload can ever start);
b. the agent confirmed that it is idle and has closed its gate (record
   ``drained`` written by the agent, and its newest event lists no payload);
c. the agent's own drain deadline expired (record ``deadline_expired``);
d. the agent is lost (no sign of life for ``lost_after_s``) **and** the local
   batch system says the job is not running.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Final

import nats.errors
from nats.aio.client import Client

from broker.manager.registry import DroneView, Registry
from remote_agent.protocol.errors import HandshakeError, RecordTampered, SchemaError
from remote_agent.protocol.events import (
    AnyCommand,
    DrainCommand,
    DrainIntent,
    ErrorReply,
    Outcome,
    RecordPhase,
    ReleaseIfIdleCommand,
    Reply,
    Snapshot,
    StatusCommand,
    decode_reply,
    encode,
    utcnow,
)
from remote_agent.protocol.handshake import RecordStore, Versioned, load_proof_key
from remote_agent.protocol.names import Namespace
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("broker.control")
#: a drone with a tampered record is asked again on every removal attempt
_tampered = RateLimitedLog(log)

#: default drain deadline when none is given: a day, so that ordinary
#: payloads end by themselves; the agent's policy decides what happens after it
DEFAULT_DRAIN_S: Final = 24 * 3600.0
#: default time to wait for an agent's answer to a command
DEFAULT_REQUEST_TIMEOUT_S: Final = 2.0


# ---------------------------------------------------------------------- answers


class CommandOutcome(enum.StrEnum):
    """How a request-reply command to an agent went"""

    ANSWERED = "answered"  #: the agent replied (see the reply's outcome)
    NO_RESPONDERS = "no_responders"  #: no agent listens on the drone's command subject
    TIMEOUT = "timeout"  #: nobody answered in time (the command may have arrived)
    ERROR_REPLY = "error_reply"  #: the agent could not understand the command
    BAD_REPLY = "bad_reply"  #: the answer was not a valid reply for this drone and request


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The answer to one command, or why there was none"""

    outcome: CommandOutcome
    reply: Reply | None = None
    detail: str = ""

    @property
    def agent_outcome(self) -> Outcome | None:
        return self.reply.outcome if self.reply is not None else None

    @property
    def snapshot(self) -> Snapshot | None:
        return self.reply.snapshot if self.reply is not None else None


class DrainOutcome(enum.StrEnum):
    """What :meth:`Control.drain` achieved"""

    ACCEPTED = "accepted"  #: intent recorded, the agent closed its gate for it
    DRAINED = "drained"  #: intent recorded, nothing ran: the agent is ending its job
    UNANSWERED = "unanswered"  #: intent recorded; the agent did not answer, it acts on reconnect
    REFUSED = "refused"  #: intent recorded, but the agent refused (see detail)
    ALREADY_DRAINING = "already_draining"  #: an earlier drain intent is in effect
    ALREADY_DRAINED = "already_drained"  #: the agent is drained already
    DEADLINE_EXPIRED = "deadline_expired"  #: an earlier drain's deadline expired
    RELEASED = "released"  #: the drone was released before it came up: nothing to drain
    NOT_ANNOUNCED = "not_announced"  #: no record: the agent never came up; release it
    TAMPERED = "tampered"  #: the record was removed or is invalid; the agent was told


@dataclass(frozen=True, slots=True)
class DrainResult:
    """The outcome of a drain, the record it left, and the agent's answer if any"""

    outcome: DrainOutcome
    phase: RecordPhase | None
    intent: DrainIntent | None = None
    command: CommandResult | None = None
    detail: str = ""

    @property
    def intent_recorded(self) -> bool:
        """Whether a drain intent is in the record (ours or an earlier one)"""
        return self.phase in (
            RecordPhase.DRAINING,
            RecordPhase.DRAINED,
            RecordPhase.DEADLINE_EXPIRED,
        )


class ReleaseOutcome(enum.StrEnum):
    """What :meth:`Control.release` achieved"""

    RELEASED = "released"  #: the manager won: no payload can ever start; remove the job
    DRAINING = "draining"  #: the agent had come up first: it was drained instead (see drain)
    TAMPERED = "tampered"  #: the record was removed or is invalid: not released, agent told


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    outcome: ReleaseOutcome
    phase: RecordPhase | None  #: ``None``: the record was removed or is invalid
    drain: DrainResult | None = None
    detail: str = ""

    @property
    def may_remove(self) -> bool:
        """Whether the batch job may be removed right away (the manager won)"""
        return self.outcome is ReleaseOutcome.RELEASED


class IdleOutcome(enum.StrEnum):
    """What :meth:`Control.release_if_idle` achieved"""

    RELEASED = "released"  #: idle: the drone is ending (or was released before it came up)
    BUSY = "busy"  #: payloads run: nothing changed
    REFUSED = "refused"  #: the agent refused (see detail)
    UNANSWERED = "unanswered"  #: no answer: nothing is known to have changed


@dataclass(frozen=True, slots=True)
class IdleResult:
    outcome: IdleOutcome
    phase: RecordPhase | None  #: ``None``: no valid record
    command: CommandResult | None = None
    detail: str = ""


class Removal(enum.StrEnum):
    """Why a drone's batch job may or may not be removed"""

    # the four safe cases
    RELEASED_BY_MANAGER = "released_by_manager"
    DRAINED_BY_AGENT = "drained_by_agent"
    DEADLINE_EXPIRED = "deadline_expired"
    LOST_AND_NOT_RUNNING = "lost_and_not_running"
    # everything else
    UNKNOWN_DRONE = "unknown_drone"
    NOT_ANNOUNCED = "not_announced"
    AGENT_UP = "agent_up"
    DRAINING = "draining"
    LOST_BUT_RUNNING = "lost_but_running"
    LOST_LBS_UNKNOWN = "lost_lbs_unknown"
    UNEXPECTED_WRITER = "unexpected_writer"
    UNPROVEN_RELEASE = "unproven_release"
    RECORD_TAMPERED = "record_tampered"
    DRAINED_BUT_BUSY = "drained_but_busy"


SAFE_REMOVALS: Final = frozenset(
    {
        Removal.RELEASED_BY_MANAGER,
        Removal.DRAINED_BY_AGENT,
        Removal.DEADLINE_EXPIRED,
        Removal.LOST_AND_NOT_RUNNING,
    }
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer of :func:`removal_verdict`: yes only in the four safe cases"""

    allowed: bool
    reason: Removal
    detail: str

    def __bool__(self) -> bool:
        return self.allowed


def removal_verdict(
    view: DroneView | None,
    lbs_running: bool | None,
    now: float,
    lost_after_s: float,
) -> Verdict:
    """
    Whether the batch job of the drone described by ``view`` may be removed

    :param view: the registry's view of the drone (``None``: nothing known)
    :param lbs_running: whether the local batch system reports the drone's job
        as running; ``None`` if unknown
    :param now: the current time, epoch seconds
    :param lost_after_s: seconds without a sign of life after which the agent
        counts as lost
    """

    def no(reason: Removal, detail: str) -> Verdict:
        return Verdict(False, reason, detail)

    def yes(reason: Removal, detail: str) -> Verdict:
        assert reason in SAFE_REMOVALS
        return Verdict(True, reason, detail)

    if view is None:
        return no(Removal.UNKNOWN_DRONE, "nothing is known about this drone: release it first")
    record = view.record
    odd: tuple[Removal, str] | None = None  # a final phase not to be trusted
    if record is not None:
        phase, writer = record.phase, record.writer
        if phase is RecordPhase.RELEASED:
            if record.proven:
                return yes(
                    Removal.RELEASED_BY_MANAGER,
                    "released before its agent came up: no payload can ever start",
                )
            odd = (Removal.UNPROVEN_RELEASE, "record released without the manager's proof")
        elif phase is RecordPhase.DRAINED and writer == "agent":
            if not view.payloads:
                return yes(Removal.DRAINED_BY_AGENT, "the agent is idle and has closed its gate")
            odd = (
                Removal.DRAINED_BUT_BUSY,
                f"record drained, but the agent's newest event lists "
                f"{len(view.payloads)} payload(s)",
            )
        elif phase is RecordPhase.DEADLINE_EXPIRED and writer == "agent":
            return yes(Removal.DEADLINE_EXPIRED, "the agent's drain deadline expired")
        elif phase in (RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED):
            odd = (Removal.UNEXPECTED_WRITER, f"record {phase!s} written by the {writer}")
        elif phase is None:
            odd = (Removal.RECORD_TAMPERED, f"the record is tampered: {record.tampered}")
    lost = view.is_lost(now, lost_after_s)
    if lost:
        seen = view.last_seen
        silent = f"no sign of life for {now - seen:.0f}s" if seen is not None else "never seen"
        if lbs_running is False:
            return yes(
                Removal.LOST_AND_NOT_RUNNING,
                f"agent lost ({silent}) and the batch system says the job is not running",
            )
        if lbs_running is None:
            return no(
                Removal.LOST_LBS_UNKNOWN,
                f"agent lost ({silent}), but the batch system's view is unknown",
            )
        return no(
            Removal.LOST_BUT_RUNNING,
            f"agent lost ({silent}), but the batch system says the job runs",
        )
    if odd is not None:
        return no(*odd)
    if record is None:
        return no(
            Removal.NOT_ANNOUNCED,
            "no handshake record: the agent may be about to claim; release it first",
        )
    if record.phase is RecordPhase.DRAINING:
        deadline = record.drain.deadline.isoformat() if record.drain else "?"
        return no(Removal.DRAINING, f"draining until {deadline}; wait for drained")
    return no(Removal.AGENT_UP, "the agent is up and may run payloads: drain it")


# ---------------------------------------------------------------------- the API


class Control:
    """
    Release, drain and ask drones; decide whether their batch jobs may be removed

    :param nc: the manager's connection (core request-reply to the agents)
    :param store: the handshake records
    :param registry: the registry fed by the event stream and the KV watch
    :param request_timeout_s: how long to wait for an agent's answer
    """

    def __init__(
        self,
        nc: Client,
        store: RecordStore,
        registry: Registry,
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        self.nc = nc
        self.store = store
        self.registry = registry
        self.request_timeout_s = request_timeout_s

    @classmethod
    async def open(
        cls,
        nc: Client,
        registry: Registry,
        *,
        domain: str | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> Control:
        """
        The control API of the manager: the handshake records with the manager's
        proof key, which ``registry`` then checks records with

        :raises HandshakeError: if the buckets do not exist or cannot be read
        """
        js = nc.jetstream(domain=domain)
        proof_key = await load_proof_key(js, registry.namespace)
        registry.proof_key = proof_key
        store = await RecordStore.open(js, registry.namespace, domain=domain, proof_key=proof_key)
        return cls(nc, store, registry, request_timeout_s=request_timeout_s)

    @property
    def namespace(self) -> Namespace:
        return self.store.namespace

    # ------------------------------------------------------------ commands

    async def command(self, command: AnyCommand) -> CommandResult:
        """
        Send one command to its drone's agent and wait for the answer

        Never raises for a missing or bad answer: the result says what happened.
        """
        subject = self.namespace.command(command.site, command.drone)
        try:
            response = await self.nc.request(
                subject, encode(command), timeout=self.request_timeout_s
            )
        except nats.errors.NoRespondersError:
            return CommandResult(CommandOutcome.NO_RESPONDERS, detail="no agent listens")
        except nats.errors.TimeoutError:
            return CommandResult(
                CommandOutcome.TIMEOUT, detail=f"no answer within {self.request_timeout_s:g}s"
            )
        try:
            reply = decode_reply(response.data)
        except SchemaError as err:
            return CommandResult(CommandOutcome.BAD_REPLY, detail=str(err))
        if isinstance(reply, ErrorReply):
            return CommandResult(CommandOutcome.ERROR_REPLY, detail=reply.error)
        if (reply.site, reply.drone, reply.request_id) != (
            command.site,
            command.drone,
            command.request_id,
        ):
            return CommandResult(
                CommandOutcome.BAD_REPLY,
                detail=f"reply of {reply.site}/{reply.drone} to request {reply.request_id!r}",
            )
        return CommandResult(CommandOutcome.ANSWERED, reply, reply.detail)

    async def status(self, site: str, drone: str) -> CommandResult:
        """Ask the agent for its snapshot"""
        return await self.command(
            StatusCommand(site=site, drone=drone, request_id=_request_id(), at=utcnow())
        )

    async def drain(
        self,
        site: str,
        drone: str,
        deadline: dt.datetime | None = None,
        reason: str = "",
    ) -> DrainResult:
        """
        Drain a drone that has announced itself: record the intent, then tell the agent

        The intent is written to the handshake record first, so an agent that
        misses the command acts on it when it reconnects.

        :param deadline: absolute deadline (UTC); default :data:`DEFAULT_DRAIN_S` from now
        :raises HandshakeError: if the record cannot be read or written
        """
        now = utcnow()
        intent = DrainIntent(
            deadline=deadline or now + dt.timedelta(seconds=DEFAULT_DRAIN_S),
            reason=reason,
            request_id=_request_id(),
            requested_at=now,
        )
        command = DrainCommand(
            site=site,
            drone=drone,
            request_id=intent.request_id,
            at=now,
            deadline=intent.deadline,
            reason=reason,
        )
        try:
            written = await self.store.request_drain(site, drone, intent)
        except RecordTampered as err:
            return await self._drain_tampered(command, intent, str(err))
        except HandshakeError:
            if await self.store.removed(site, drone):
                return await self._drain_tampered(command, intent, "the record was removed")
            if await self.store.read(site, drone) is None:
                return DrainResult(
                    DrainOutcome.NOT_ANNOUNCED,
                    None,
                    detail="no handshake record: the agent never came up; release it instead",
                )
            raise
        record = written.record
        self._note_record(written)
        if record.phase is RecordPhase.RELEASED and not self.store.proven(record):
            return await self._drain_tampered(
                command, intent, "record released without the manager's proof"
            )
        if record.phase is not RecordPhase.DRAINING or record.drain != intent:
            return _drain_already(record.phase, written)
        answer = await self.command(command)
        outcome = _drain_outcome(answer)
        log.info(
            "drain of %s/%s until %s: %s (%s)",
            site,
            drone,
            intent.deadline.isoformat(),
            outcome,
            answer.detail or answer.outcome,
            extra={"drone": drone, "site": site, "request_id": intent.request_id},
        )
        return DrainResult(outcome, record.phase, intent, answer, answer.detail)

    async def _drain_tampered(
        self, command: DrainCommand, intent: DrainIntent, why: str
    ) -> DrainResult:
        """
        A drain of a drone whose record was removed or is invalid

        Nothing can be recorded; the command alone tells an agent that is up
        (which closed its gate when it saw its record go, and drains itself).
        """
        answer = await self.command(command)
        _tampered.warning(
            "tampered",
            "drain of %s/%s: %s; asked its agent directly (%s)",
            command.site,
            command.drone,
            why,
            answer.detail or answer.outcome,
            extra={"drone": command.drone, "site": command.site},
        )
        return DrainResult(DrainOutcome.TAMPERED, None, intent, answer, why)

    async def release(
        self,
        site: str,
        drone: str,
        *,
        note: str = "",
        deadline: dt.datetime | None = None,
        reason: str = "",
    ) -> ReleaseResult:
        """
        Release a drone: win the race with its agent, or drain it if the agent won

        :param deadline: deadline of the drain if the agent had come up first
        :raises HandshakeError: if the record cannot be read or written
        """
        try:
            written = await self.store.release(site, drone, note=note)
        except RecordTampered as err:
            drained = await self.drain(site, drone, deadline, reason or note or "released")
            return ReleaseResult(ReleaseOutcome.TAMPERED, None, drained, detail=str(err))
        self._note_record(written)
        record = written.record
        if record.phase is RecordPhase.RELEASED and self.store.proven(record):
            return ReleaseResult(
                ReleaseOutcome.RELEASED,
                record.phase,
                detail="released before the agent came up: no payload can ever start",
            )
        drained = await self.drain(site, drone, deadline, reason or note or "released")
        return ReleaseResult(
            ReleaseOutcome.DRAINING,
            drained.phase or record.phase,
            drained,
            detail=f"the agent had come up ({record.phase}): drain {drained.outcome}",
        )

    async def release_if_idle(self, site: str, drone: str) -> IdleResult:
        """
        End the drone if nothing runs on it; change nothing otherwise

        A drone that never announced itself is idle by definition: it is
        released through the record (the manager wins or the agent just came
        up, in which case the agent is asked).
        """
        phase: RecordPhase | None
        try:
            current = await self.store.read(site, drone)
            if current is None:
                current = await self.store.release(site, drone, note="release if idle")
            self._note_record(current)
            phase = current.record.phase
        except RecordTampered:
            phase = None  # ask the agent all the same: it is the authority on idle
        else:
            if phase is RecordPhase.RELEASED and self.store.proven(current.record):
                return IdleResult(IdleOutcome.RELEASED, phase, detail="released")
        answer = await self.command(
            ReleaseIfIdleCommand(site=site, drone=drone, request_id=_request_id(), at=utcnow())
        )
        if answer.outcome is not CommandOutcome.ANSWERED:
            return IdleResult(IdleOutcome.UNANSWERED, phase, answer, answer.detail)
        if answer.agent_outcome in (Outcome.RELEASED, Outcome.DRAINED):
            outcome = IdleOutcome.RELEASED
        elif answer.agent_outcome is Outcome.BUSY:
            outcome = IdleOutcome.BUSY
        else:
            outcome = IdleOutcome.REFUSED
        return IdleResult(outcome, phase, answer, answer.detail)

    # ------------------------------------------------------------ removal

    def may_remove(
        self, site: str, drone: str, lbs_running: bool | None, now: float | None = None
    ) -> Verdict:
        """
        Whether the drone's batch job may be removed now (see :func:`removal_verdict`)

        Reads the registry only. Its record phases can lag behind the bucket by
        the KV watch's latency, but the safe phases are final, so a lagging
        view can only say "not yet", never a wrong "yes".
        """
        return removal_verdict(
            self.registry.view(site, drone),
            lbs_running,
            time.time() if now is None else now,
            self.registry.lost_after_s,
        )

    def _note_record(self, versioned: Versioned) -> None:
        """Merge a record we just read or wrote, ahead of the KV watch (which confirms it)"""
        self.registry.apply_record(versioned.record, versioned.revision, None)


def _request_id() -> str:
    return uuid.uuid4().hex[:16]


def _drain_already(phase: RecordPhase, written: Versioned) -> DrainResult:
    record = written.record
    outcome = {
        RecordPhase.DRAINING: DrainOutcome.ALREADY_DRAINING,
        RecordPhase.DRAINED: DrainOutcome.ALREADY_DRAINED,
        RecordPhase.DEADLINE_EXPIRED: DrainOutcome.DEADLINE_EXPIRED,
        RecordPhase.RELEASED: DrainOutcome.RELEASED,
    }.get(phase, DrainOutcome.ALREADY_DRAINING)
    detail = {
        DrainOutcome.ALREADY_DRAINING: "an earlier drain is in effect",
        DrainOutcome.ALREADY_DRAINED: "the agent is drained already",
        DrainOutcome.DEADLINE_EXPIRED: "an earlier drain's deadline expired",
        DrainOutcome.RELEASED: "released before the agent came up; nothing to drain",
    }[outcome]
    if record.drain is not None and outcome is not DrainOutcome.RELEASED:
        detail += f" (deadline {record.drain.deadline.isoformat()})"
    return DrainResult(outcome, phase, record.drain, detail=detail)


def _drain_outcome(answer: CommandResult) -> DrainOutcome:
    if answer.outcome is not CommandOutcome.ANSWERED:
        return DrainOutcome.UNANSWERED
    agent = answer.agent_outcome
    if agent in (Outcome.DRAIN_ACCEPTED, Outcome.ALREADY_DRAINING):
        # the agent may have read our intent from its record before the command came
        return DrainOutcome.ACCEPTED
    if agent in (Outcome.DRAINED, Outcome.RELEASED):
        return DrainOutcome.DRAINED
    return DrainOutcome.REFUSED
