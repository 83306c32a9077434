"""
What the control API's operations achieved: enums and frozen dataclasses for TARDIS and operators

Its rule: each answer says what actually happened, never what was asked for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from remote_agent.protocol.events import DrainIntent, Outcome, RecordPhase, Reply, Snapshot


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
