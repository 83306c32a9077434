"""
The wire contract: every message on the bus as a tagged msgspec struct, and its typed decoders

Both sides import this module, and nothing else defines wire messages (their enumerations
are in :mod:`remote_agent.protocol.states` and exported here); the ``kind`` field
selects the type, ``v`` is the major schema version. How the schema may change is in
``docs/protocol.md`` ("Versioning rules"). An event speaks only for the site, drone and
kind of its subject: the one sender rule, :func:`sender_mismatch`.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Final, Literal

import msgspec

from remote_agent.protocol.codec import SCHEMA_VERSION, Codec
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.fields import (
    DEFAULT_MAX_SIZE,
    MAX_PAYLOADS,
    NonNegative,
    Seconds,
    Token,
    UtcTime,
    check_tokens,
)
from remote_agent.protocol.names import TOKEN_CHARS, Namespace, event_subject

# the wire's enumerations live in their own module; both sides name them through this one
from remote_agent.protocol.states import DroneState as DroneState
from remote_agent.protocol.states import Outcome as Outcome
from remote_agent.protocol.states import PayloadEnd as PayloadEnd
from remote_agent.protocol.states import RecordPhase as RecordPhase


def utcnow() -> dt.datetime:
    """The current time as the timezone-aware UTC value every message carries"""
    return dt.datetime.now(dt.UTC)


_SITE_DRONE: Final = ("site", "drone")


# --------------------------------------------------------------------------- parts
#
# Every wire struct is ``gc=False``: frozen and holding only scalars, strings and other
# wire structs, a message cannot be part of a reference cycle.


class Payload(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One payload (overlay job) running on the drone"""

    job_id: str
    slot: str = ""
    started_at: UtcTime
    #: the runtime its job ad requests or expects, in seconds (nil: the ad gives none)
    requested_s: Seconds | None = None


class DrainIntent(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """
    A request to drain by a deadline, both times from the clock of its writer

    What counts is :attr:`duration_s`, the difference of the two: the agent counts it on
    its monotonic clock from when it received the intent, the manager from when the bus
    stored it, so neither compares its clock with the other's.
    """

    deadline: UtcTime
    reason: str = ""
    request_id: str = ""
    requested_at: UtcTime

    @property
    def duration_s(self) -> float:
        """Seconds from the request to the deadline, by the writer's clock (0 if before it)"""
        return max(0.0, (self.deadline - self.requested_at).total_seconds())


class DroneEnd(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """
    When the drone's batch job ends, as its agent knows it: a span, never a time

    :attr:`in_s` counts from the ``at`` of the event that carries it (a reply's: from when
    the agent sent it), so a reader places the end on its own clock as the time it learned
    of the event plus the span, and no reader compares the drone's clock with its own.
    """

    in_s: Seconds  #: seconds left until the end
    #: where the agent learned it, for people: ``SLURM_JOB_END_TIME``, ``squeue``, ...
    source: str = ""
    #: the signal by which the batch system announced the end ahead (``SIGTERM``,
    #: ``SIGUSR1``, ...); empty for an end the agent learned at its start
    notice: str = ""


class Snapshot(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Everything the agent knows about its drone; carried by heartbeats and replies"""

    state: DroneState
    since: UtcTime  #: when ``state`` was entered
    gate_open: bool
    slots: NonNegative = 0
    payloads: Annotated[list[Payload], msgspec.Meta(max_length=MAX_PAYLOADS)] = []
    drain: DrainIntent | None = None
    worker_pid: int | None = None
    started_at: UtcTime  #: when this incarnation of the agent started
    #: when the batch system ends the drone; nil: the agent knows of no end
    end: DroneEnd | None = None


# --------------------------------------------------------------------------- messages


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Base of everything on the wire"""

    v: int = SCHEMA_VERSION


class Event(Message, frozen=True, kw_only=True):
    """A fact published by one drone's agent on ``<prefix>.<site>.<drone>.evt.<kind>``"""

    site: Token
    drone: Token
    #: id of this run of the agent; a restarted agent has a new one
    incarnation: Token
    #: per-drone sequence, strictly increasing across incarnations; orders and dedupes
    seq: NonNegative
    at: UtcTime
    #: dedupe id, also sent as the ``Nats-Msg-Id`` header
    id: str
    #: the drone's whole state right after this event, so that the event with the
    #: highest ``seq`` alone tells the truth whatever was lost, repeated or reordered
    snapshot: Snapshot

    def __post_init__(self) -> None:
        chars = TOKEN_CHARS  # inlined: this runs for every event the manager reads
        if self.site.strip(chars) or self.drone.strip(chars) or self.incarnation.strip(chars):
            check_tokens(self, ("site", "drone", "incarnation"))


class AgentStarted(Event, frozen=True, kw_only=True, tag="agent_started"):
    agent_version: str
    hostname: str = ""
    pid: int
    worker_command: list[str] = []


class WorkerStarted(Event, frozen=True, kw_only=True, tag="worker_started"):
    pid: int
    command: list[str]


class WorkerExited(Event, frozen=True, kw_only=True, tag="worker_exited"):
    pid: int
    exit_code: int | None = None  #: set when the worker exited
    signal: int | None = None  #: set when a signal ended the worker


class StartdReady(Event, frozen=True, kw_only=True, tag="startd_ready"):
    slots: NonNegative
    name: str = ""


class PayloadStarted(Event, frozen=True, kw_only=True, tag="payload_started"):
    job_id: str
    slot: str = ""


class PayloadFinished(Event, frozen=True, kw_only=True, tag="payload_finished"):
    job_id: str
    slot: str = ""
    how: PayloadEnd
    exit_code: int | None = None
    duration_s: Seconds | None = None
    #: the agent evicted it through the startd (the drone's end, or the ``kill`` deadline
    #: policy), which puts it back into the overlay pool's queue: vacated, not killed
    vacated: bool = False


class GateOpened(Event, frozen=True, kw_only=True, tag="gate_opened"):
    reason: str = ""


class GateClosed(Event, frozen=True, kw_only=True, tag="gate_closed"):
    reason: str = ""


class DrainRequested(Event, frozen=True, kw_only=True, tag="drain_requested"):
    intent: DrainIntent


class DrainAccepted(Event, frozen=True, kw_only=True, tag="drain_accepted"):
    intent: DrainIntent
    payloads: NonNegative


class DrainRefused(Event, frozen=True, kw_only=True, tag="drain_refused"):
    request_id: str = ""
    reason: str


class Draining(Event, frozen=True, kw_only=True, tag="draining"):
    payloads: NonNegative
    deadline: UtcTime


class Drained(Event, frozen=True, kw_only=True, tag="drained"):
    pass


class DrainDeadlineExpired(Event, frozen=True, kw_only=True, tag="drain_deadline_expired"):
    payloads: NonNegative
    #: what the agent does about the payloads still running (its configured policy)
    action: Literal["kill", "wait"]


class Released(Event, frozen=True, kw_only=True, tag="released"):
    reason: str = ""


class AgentExiting(Event, frozen=True, kw_only=True, tag="agent_exiting"):
    exit_code: int
    reason: str = ""


class Heartbeat(Event, frozen=True, kw_only=True, tag="heartbeat"):
    """Sent every ``interval_s`` and as the agent's very last event"""

    interval_s: Seconds


class _Exchange(Message, frozen=True, kw_only=True):
    """What a command and its reply both carry: the drone and the request"""

    site: Token
    drone: Token
    request_id: str

    def __post_init__(self) -> None:
        check_tokens(self, _SITE_DRONE)


class Command(_Exchange, frozen=True, kw_only=True):
    """A request from the manager to one drone, sent to ``<prefix>.<site>.<drone>.cmd``"""

    at: UtcTime


class DrainCommand(Command, frozen=True, kw_only=True, tag="drain"):
    deadline: UtcTime
    reason: str = ""


class ReleaseIfIdleCommand(Command, frozen=True, kw_only=True, tag="release_if_idle"):
    pass


class StatusCommand(Command, frozen=True, kw_only=True, tag="status"):
    pass


class Reply(_Exchange, frozen=True, kw_only=True, tag="reply"):
    """The agent's answer to a command: what it actually did, and its state after it"""

    outcome: Outcome
    detail: str = ""
    snapshot: Snapshot


class ErrorReply(Message, frozen=True, kw_only=True, tag="error"):
    """The answer to a request that could not be understood; nothing was changed"""

    error: str
    request_id: str = ""


class DroneRecord(Message, frozen=True, kw_only=True, tag="record"):
    """
    The value of a drone's key in the handshake KV bucket

    Written with compare-and-set only, so that of "agent: up" and "manager:
    released" exactly one wins.
    """

    site: Token
    drone: Token
    phase: RecordPhase
    writer: Literal["agent", "manager"]
    incarnation: str = ""
    drain: DrainIntent | None = None
    at: UtcTime
    note: str = ""
    #: the manager's HMAC-SHA256 of this record (with an empty ``proof``) under a
    #: key that drones cannot read; set on the phases only the manager writes
    #: (:func:`remote_agent.protocol.proof.record_proof`); drones write none and ignore it
    proof: bytes = b""

    def __post_init__(self) -> None:
        check_tokens(self, _SITE_DRONE)


class TardisState(Message, frozen=True, kw_only=True, tag="tardis_state"):
    """
    A manager note: TARDIS moved one drone into another state

    Published by the TARDIS integration (``broker/tardis_adapter.py``) on
    ``<prefix>.<site>.<drone>.mgr.tardis_state``, so that a drone's timeline
    shows TARDIS's view beside the drone's own events. The registry reads
    them to see a drone's end: TARDIS's ``DownState`` (``broker/manager/lifecycle.py``).
    """

    site: Token
    drone: Token
    #: the TARDIS state entered, its class name, e.g. ``BootingState``
    state: str
    #: the drone's ``ResourceStatus`` as TARDIS held it then, e.g. ``Running``
    resource_status: str = ""
    at: UtcTime
    #: dedupe id, also sent as the ``Nats-Msg-Id`` header
    id: str = ""

    def __post_init__(self) -> None:
        check_tokens(self, _SITE_DRONE)


AnyEvent = (
    AgentStarted
    | WorkerStarted
    | WorkerExited
    | StartdReady
    | PayloadStarted
    | PayloadFinished
    | GateOpened
    | GateClosed
    | DrainRequested
    | DrainAccepted
    | DrainRefused
    | Draining
    | Drained
    | DrainDeadlineExpired
    | Released
    | AgentExiting
    | Heartbeat
)
AnyCommand = DrainCommand | ReleaseIfIdleCommand | StatusCommand
AnyReply = Reply | ErrorReply
#: notes the manager publishes about a drone (``<prefix>.<site>.<drone>.mgr.<kind>``)
AnyNote = TardisState
AnyMessage = AnyEvent | AnyCommand | AnyReply | DroneRecord | AnyNote

EVENT_TYPES: Final[tuple[type[Event], ...]] = AnyEvent.__args__
COMMAND_TYPES: Final[tuple[type[Command], ...]] = AnyCommand.__args__
MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    *EVENT_TYPES,
    *COMMAND_TYPES,
    Reply,
    ErrorReply,
    DroneRecord,
    TardisState,
)


def kind_of(message_type: type[Message]) -> str:
    """The ``kind`` tag of a message type"""
    tag = message_type.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


#: the ``kind`` tag of every event type, looked up once
EVENT_KINDS: Final[dict[type[Event], str]] = {t: kind_of(t) for t in EVENT_TYPES}
#: the kind of TARDIS's state note, the last token of its subject
TARDIS_STATE: Final = kind_of(TardisState)


# --------------------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    """Encode ``message`` as MessagePack"""
    return _encoder.encode(message)


_any = Codec[AnyMessage](AnyMessage, "message")
_events = Codec[AnyEvent](AnyEvent, "event")
_commands = Codec[AnyCommand](AnyCommand, "command")
_replies = Codec[AnyReply](AnyReply, "reply")
_records = Codec[DroneRecord](DroneRecord, "drone record")
_notes = Codec[AnyNote](AnyNote, "manager note")


def decode(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> AnyMessage:
    """
    Decode any message type

    :raises SchemaError: for malformed bytes, wrong types, missing fields,
        unknown kinds, an unsupported version, or more than ``max_size`` bytes
    """
    return _any.decode(data, max_size)


def decode_event(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> AnyEvent:
    """Decode an event; any other message is a :class:`SchemaError`"""
    return _events.decode(data, max_size)


def decode_command(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> AnyCommand:
    """Decode a command; any other message is a :class:`SchemaError`"""
    return _commands.decode(data, max_size)


def decode_reply(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> AnyReply:
    """Decode a command's reply; any other message is a :class:`SchemaError`"""
    return _replies.decode(data, max_size)


def decode_record(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> DroneRecord:
    """Decode a handshake record; any other message is a :class:`SchemaError`"""
    return _records.decode(data, max_size)


def decode_note(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> AnyNote:
    """Decode a manager note; any other message is a :class:`SchemaError`"""
    return _notes.decode(data, max_size)


def to_json(message: Message) -> bytes:
    """The message as JSON, timestamps in RFC 3339; for people and tools, not the bus"""
    return msgspec.json.encode(message)


# --------------------------------------------------------------------------- the sender rule
# an event speaks only for the site, drone and kind of its subject


def sender_mismatch(event: Event, subject: str, prefix: str) -> str | None:
    """
    Why ``event`` does not speak for the site, drone and kind that ``subject`` names,
    or ``None`` if it does: the one sender rule

    Per-drone NATS permissions bind a drone's credentials to its subjects; this
    rule binds the message body to the subject, so a drone cannot speak for
    another even through a mislabelled body. Site and drone are tokens (no dots),
    so one comparison of the whole subject says the same as comparing its parts;
    only a mismatch is split.

    :raises SchemaError: if ``subject`` is not an event subject of ``prefix``
    """
    kind = EVENT_KINDS[type(event)]
    if subject == event_subject(prefix, event.site, event.drone, kind):
        return None
    site, drone, subject_kind = Namespace(prefix).parse_event_subject(subject)
    return (
        f"event {kind!r} for {event.site}/{event.drone} "
        f"arrived on the subject of {site}/{drone} ({subject_kind!r})"
    )


def check_sender(event: Event, subject: str, namespace: Namespace) -> None:
    """
    Ensure that ``event`` speaks for the drone whose subject it came on (:func:`sender_mismatch`)

    :raises SchemaError: if site, drone or kind disagree with ``subject``
    """
    mismatch = sender_mismatch(event, subject, namespace.prefix)
    if mismatch is not None:
        raise SchemaError(mismatch)
