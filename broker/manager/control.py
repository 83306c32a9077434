"""
The manager's control API: release, drain, release-if-idle, status, and may-remove

Its rule: every operation that can end a drone goes through the handshake record
first (:class:`remote_agent.protocol.handshake.RecordStore`), so that its effect does
not depend on a message arriving; the request-reply command to the agent only makes
it fast. Whether a batch job may be removed is :func:`~broker.manager.verdict.removal_verdict`'s
alone.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from typing import Final

import nats.errors
from nats.aio.client import Client

from broker.manager.outcomes import (
    CommandOutcome,
    CommandResult,
    DrainOutcome,
    DrainResult,
    IdleOutcome,
    IdleResult,
    ReleaseOutcome,
    ReleaseResult,
)
from broker.manager.registry import Registry
from broker.manager.verdict import Verdict, removal_verdict, up_without_record
from remote_agent.protocol.errors import HandshakeError, RecordTampered, SchemaError
from remote_agent.protocol.events import (
    AnyCommand,
    DrainCommand,
    DrainIntent,
    ErrorReply,
    Outcome,
    RecordPhase,
    ReleaseIfIdleCommand,
    StatusCommand,
    decode_reply,
    encode,
    utcnow,
)
from remote_agent.protocol.handshake import RecordStore, Versioned
from remote_agent.protocol.names import Namespace
from remote_agent.protocol.proof import load_proof_key
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.control")
#: a drone with a tampered record is asked again on every removal attempt
_tampered = RateLimitedLog(log)

#: default drain deadline when none is given: a day, so that ordinary
#: payloads end by themselves; the agent's policy decides what happens after it
DEFAULT_DRAIN_S: Final = 24 * 3600.0
#: default time to wait for an agent's answer to a command
DEFAULT_REQUEST_TIMEOUT_S: Final = 2.0

#: why a drone whose agent reports itself up, and has no record, is drained, not released
_UP_WITHOUT_RECORD: Final = (
    "no handshake record, but its agent reports its gate open or payloads "
    "(its record was retired while the agent was away)"
)


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
        store = await RecordStore.open(
            js, registry.namespace, domain=domain, proof_key=proof_key, logger=log
        )
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
            if up_without_record(self.registry.view(site, drone)):
                return await self._drain_tampered(command, intent, _UP_WITHOUT_RECORD)
            if await self.store.read(site, drone) is None:
                return DrainResult(
                    DrainOutcome.NOT_ANNOUNCED,
                    None,
                    detail="no handshake record: the agent never came up; release it instead",
                )
            # its agent claimed the record after the drain found none: drain it there
            written = await self.store.request_drain(site, drone, intent)
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
        if up_without_record(self.registry.view(site, drone)):
            # a key without a record, but not one never written: no release can win
            drained = await self.drain(site, drone, deadline, reason or note or "released")
            return ReleaseResult(ReleaseOutcome.TAMPERED, None, drained, detail=_UP_WITHOUT_RECORD)
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

    async def drain_or_release(
        self,
        site: str,
        drone: str,
        deadline: dt.datetime | None = None,
        reason: str = "",
    ) -> DrainResult | ReleaseResult:
        """
        Drain a drone whose agent claimed its record; release one whose agent has not

        A drone without a record has run nothing (its gate opens only with its agent's
        claim), so a drain of it is its release: its agent's claim then finds the record
        released and never opens the gate, and its batch job may be removed at once.
        Had the agent claimed in between, the release drains it through the claimed
        record (:meth:`release`).

        :param deadline: deadline of the drain; default :data:`DEFAULT_DRAIN_S` from now
        :raises HandshakeError: if the record cannot be read or written
        """
        drained = await self.drain(site, drone, deadline, reason)
        if drained.outcome is not DrainOutcome.NOT_ANNOUNCED:
            return drained
        return await self.release(site, drone, note=reason, deadline=deadline, reason=reason)

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
            if current is None and up_without_record(self.registry.view(site, drone)):
                raise RecordTampered(_UP_WITHOUT_RECORD)
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
