"""
One drone's life: its agent's events beside TARDIS's state, read from the event stream

Rows are in the order the stream stored them (the writers' clocks may be off),
and only what the registry accepts is shown (an event must pass
:func:`broker.manager.validity.check_event`, a note must speak for the drone
and kind of its subject), so the last agent row is the state the registry holds.
A drone that has ended gets a last row with why: a registry fed the same
messages and the drone's record decides it, by the registry's own rule.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DeliverPolicy

from broker.errors import Rejected, TimelineError
from broker.jetstream.messages import metadata
from broker.jetstream.reads import read_all, stream_errors
from broker.manager.handler import event_reader
from broker.manager.records import load_records
from broker.manager.registry import DEFAULT_LOST_AFTER_S, Registry
from broker.manager.tardis_notes import check_note
from broker.manager.validity import UNSTORED, Headers, check_event
from broker.manager.views import DroneView
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.events import (
    AgentExiting,
    AgentStarted,
    DrainAccepted,
    DrainDeadlineExpired,
    Draining,
    DrainRefused,
    DrainRequested,
    DroneEnd,
    Event,
    GateClosed,
    GateOpened,
    Heartbeat,
    Message,
    PayloadFinished,
    PayloadStarted,
    Released,
    StartdReady,
    TardisState,
    WorkerExited,
    WorkerStarted,
    kind_of,
)
from remote_agent.protocol.names import Namespace, api_prefix, is_note_subject
from remote_agent.protocol.proof import load_proof_key


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a drone's timeline"""

    at: float  #: when it happened (the writer's clock), epoch seconds
    stream_seq: int | None  #: order in the stream: the order of the rows (``None``: the end)
    drone_event: str  #: what the agent reported, e.g. ``payload_started 12.0``
    drone_state: str  #: the agent's state right after it
    tardis_state: str  #: TARDIS's state then (a change is marked with ``->``)
    source: str  #: ``agent``, ``tardis``, or ``manager`` for the drone's end


def _deadline(deadline: dt.datetime, at: dt.datetime) -> str:
    """A deadline as the timeline shows it: its time, with its date when not that of ``at``"""
    deadline = deadline.astimezone(dt.UTC)
    if deadline.date() == at.astimezone(dt.UTC).date():
        return f"{deadline:%H:%M:%S}"
    return f"{deadline:%Y-%m-%d %H:%M:%S}"


#: a drain read from the handshake record, which the agent cannot prove is the manager's,
#: counts no sooner than its self-drain until the manager's command confirms it
_HELD = "held to the self-drain deadline until the manager's command confirms the one asked for"


def describe(event: Event) -> str:
    """A short text of one event: its kind and what matters about it"""
    kind = kind_of(type(event))
    if isinstance(event, PayloadStarted):
        return f"{kind} {event.job_id}"
    if isinstance(event, PayloadFinished):
        code = "" if event.exit_code is None else f", code {event.exit_code}"
        return f"{kind} {event.job_id} ({event.how}{code})"
    if isinstance(event, GateOpened | GateClosed | Released | DrainRefused) and event.reason:
        return f"{kind}: {event.reason}"
    if isinstance(event, DrainRequested | DrainAccepted):
        text = f"{kind}, deadline {_deadline(event.intent.deadline, event.at)}"
        return f"{text}, {event.payloads} payload(s)" if isinstance(event, DrainAccepted) else text
    if isinstance(event, Draining):
        return (
            f"{kind}: {event.payloads} payload(s), deadline {_deadline(event.deadline, event.at)}"
        )
    if isinstance(event, DrainDeadlineExpired):
        return f"{kind}: {event.payloads} payload(s), {event.action}"
    if isinstance(event, StartdReady):
        return f"{kind}: {event.slots} slot(s)"
    if isinstance(event, WorkerStarted):
        return f"{kind}: pid {event.pid}"
    if isinstance(event, WorkerExited):
        end = f"signal {event.signal}" if event.signal is not None else f"exit {event.exit_code}"
        return f"{kind}: {end}"
    if isinstance(event, AgentExiting):
        return f"{kind}: exit {event.exit_code}" + (f", {event.reason}" if event.reason else "")
    if isinstance(event, AgentStarted):
        return f"{kind} on {event.hostname or '?'}"
    return kind


def end_change(before: DroneEnd | None, after: DroneEnd | None) -> str | None:
    """
    The row a change of a drone's end makes, or ``None``: the end first known, a notice

    Not an event kind of its own: the end travels in every snapshot (an optional field,
    which older readers skip and drones publish under the subjects their credentials
    already allow), and the row appears with the first event that carries the change.
    """
    if after is None:
        return None
    if after.notice and (before is None or before.notice != after.notice):
        return f"end notice ({after.notice}): the drone ends in {after.in_s:.0f}s"
    if before is None:
        source = f" ({after.source})" if after.source else ""
        return f"end known: in {after.in_s:.0f}s{source}"
    return None


def check_message(
    data: bytes,
    subject: str,
    namespace: Namespace,
    headers: Headers = UNSTORED,
) -> Event | TardisState:
    """
    The event or manager note in ``data`` if the registry would accept it on ``subject``

    :param headers: as for :func:`broker.manager.validity.check_event`
    :raises Rejected: otherwise
    """
    if not is_note_subject(subject):
        return check_event(data, subject, namespace.prefix, headers=headers)
    return check_note(data, subject, namespace.prefix, headers=headers)


def build(messages: Sequence[tuple[int, Message]], *, heartbeats: bool = False) -> list[Row]:
    """
    The rows of a timeline from ``(stream sequence, message)`` pairs, in stream order

    Heartbeats are left out unless ``heartbeats``; TARDIS's state is carried
    forward to every row. A change of the drone's end (:func:`end_change`) gets a row of
    its own before the event that first carries it, a heartbeat too.
    """
    items: list[tuple[float, int, Message]] = []
    for seq, message in messages:
        if isinstance(message, Event | TardisState):
            items.append((message.at.timestamp(), seq, message))
    items.sort(key=lambda item: item[1])
    rows: list[Row] = []
    tardis = ""
    drone_state = ""
    end: DroneEnd | None = None
    requested: dt.datetime | None = None  #: the deadline of the last drain_requested
    for at, seq, message in items:
        if isinstance(message, TardisState):
            status = f" ({message.resource_status})" if message.resource_status else ""
            tardis = f"{message.state}{status}"
            rows.append(Row(at, seq, "", drone_state, f"-> {tardis}", "tardis"))
            continue
        assert isinstance(message, Event)
        drone_state = str(message.snapshot.state)
        change = end_change(end, message.snapshot.end)
        end = message.snapshot.end or end
        if change is not None:
            rows.append(Row(at, seq, change, drone_state, tardis, "agent"))
        if isinstance(message, Heartbeat) and not heartbeats:
            continue
        text = describe(message)
        if isinstance(message, DrainRequested):
            requested = message.intent.deadline
        elif (
            isinstance(message, DrainAccepted)
            and requested is not None
            and message.intent.deadline > requested
        ):
            text += f" ({_HELD}, {_deadline(requested, message.at)})"
        rows.append(Row(at, seq, text, drone_state, tardis, "agent"))
    return rows


def end_row(rows: Sequence[Row], view: DroneView | None) -> Row | None:
    """The last row of a drone whose life has ended in ``view``: when, and why"""
    if view is None or not view.ended or view.ended_time is None:
        return None
    last = rows[-1] if rows else None
    tardis = last.tardis_state.removeprefix("-> ") if last is not None else ""
    state = last.drone_state if last is not None else ""
    return Row(view.ended_time, None, f"ended: {view.ended}", state, tardis, "manager")


async def read_timeline(
    nc: Client,
    namespace: Namespace,
    drone: str,
    site: str | None = None,
    *,
    domain: str | None = None,
    heartbeats: bool = False,
    lost_after_s: float = DEFAULT_LOST_AFTER_S,
) -> list[Row]:
    """
    Every valid event and manager note of one drone in the stream, as timeline rows,
    and its end if it has ended

    Messages the registry rejects are left out (it counts them). The end is decided
    as the manager does, with the drone's record (so none once it is retired, unless
    TARDIS removed it) and ``lost_after_s`` for a drained drone that fell silent.

    :raises TimelineError: if the stream or the bucket cannot be read
    """
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, filter_subjects=namespace.timeline_subjects(drone, site)
    )
    messages: list[tuple[int, Message]] = []
    registry = Registry(namespace, lost_after_s=lost_after_s, retain_lost_s=0, warn_clocks=False)
    apply = event_reader(registry, None)

    def collect(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        try:
            message = check_message(data, subject, namespace, headers)
        except Rejected:
            return
        messages.append((metadata(reply)[0], message))
        apply(subject, reply, data, headers)

    js = nc.jetstream(domain=domain)
    api = api_prefix(domain)
    with stream_errors(TimelineError, "stream or bucket"):
        await read_all(nc, js, namespace.event_stream, config, collect, headers=True, api=api)
        with contextlib.suppress(HandshakeError):  # without it, no release reads as proven
            registry.proof_key = await load_proof_key(js, namespace)
        for site_of in {site for site, _ in registry.views()}:
            await load_records(
                nc, js, registry, api=api, subject=namespace.record_subject(site_of, drone)
            )
    rows = build(messages, heartbeats=heartbeats)
    registry.mark_ended(time.time())
    ends = (end_row(rows, view) for view in registry.views().values())
    return rows + [row for row in ends if row is not None]
