"""
The two ways an event-stream message reaches the registry: the durable consumer's
handler and the rebuild's reader

Both take a message's time and order from the stream (its reply subject), so a
replay after a restart sees the same times and the same order. The consumer's handler
applies each drone's events within its budget (:mod:`broker.manager.budget`) and releases
what the registry held with one timer for all drones; the rebuild applies everything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from broker.jetstream.messages import Disposition, Handler, metadata
from broker.manager.registry import Applied, Registry
from remote_agent.protocol.events import EVENT_TYPES, TARDIS_STATE, kind_of
from remote_agent.protocol.names import is_note_subject

log = logging.getLogger("cobald.runtime.cobald_remote.registry")

#: what the registry's ``apply_message`` and ``apply_note_message`` take
_Apply = Callable[[bytes, str, float, int | None, Mapping[str, str] | None], Applied]


def note_handler(registry: Registry) -> Handler:
    """The notes consumer's handler: apply each TARDIS state note, then ack or term"""
    return _stored_handler(registry.apply_note_message)


def event_handler(registry: Registry, clock: Callable[[], float] = time.monotonic) -> Handler:
    """
    The consumer's handler: apply each event to ``registry``, then say ack or term

    The event's time of arrival is the time the stream stored it (from the
    reply subject), so a replay after a restart sees the same times.
    Rejected events are termed: redelivering them could never help. An event
    beyond its drone's budget is acked too: the registry holds it, and a timer of
    the running event loop applies it when the budget allows.

    :param clock: the seconds the held events are timed by
    """
    apply_message = registry.apply_message
    releases = _Releases(registry, clock)
    held = Applied.HELD

    def apply(
        data: bytes,
        subject: str,
        received: float,
        stream_seq: int | None,
        headers: Mapping[str, str] | None,
    ) -> Applied:
        result = apply_message(data, subject, received, stream_seq, headers, now=clock())
        if result is held:
            releases.arm()
        return result

    return _stored_handler(apply)


class _Releases:
    """One timer on the running loop for every held event: it fires when the next is due"""

    def __init__(self, registry: Registry, clock: Callable[[], float]) -> None:
        self._registry = registry
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """
        Fire when the registry's next held event is due, unless armed already

        Every event is due within one interval of the budget after it was held, so one
        that falls due before the timer fires waits at most that long too.
        """
        if self._timer is not None:
            return
        due = self._registry.next_release
        if due is not None:
            delay = max(0.0, due - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        try:
            self._registry.release_held(self._clock())
        except Exception:  # a watcher's bug: the events held for the others still go out
            log.exception("applying held events failed")
        self.arm()


def _stored_handler(apply: _Apply) -> Handler:
    """A consumer's handler: ``apply`` each message by its stream order and time, ack or term"""
    rejected = Applied.REJECTED
    ack = Disposition.ACK
    term = Disposition.TERM

    def handle(
        subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> Disposition:
        try:
            stream_seq, _, received, _ = metadata(reply)
        except ValueError:  # not from JetStream: nothing to order it by
            return term
        return term if apply(data, subject, received, stream_seq, headers) is rejected else ack

    return handle


def event_reader(
    registry: Registry, hidden: set[str] | None
) -> Callable[[str, str, bytes, Mapping[str, str] | None], None]:
    """
    A read_all handler applying events and TARDIS notes by stream sequence; the
    subjects of rejected events that may hide a valid one go into ``hidden``
    """
    apply = registry.apply_message
    kinds = frozenset(kind_of(event_type) for event_type in EVENT_TYPES)
    prefix = registry.namespace.prefix
    notes = frozenset({TARDIS_STATE})

    apply_note = registry.apply_note_message

    def on_event(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        stream_seq, _, stored, _ = metadata(reply)
        note = is_note_subject(subject)
        result = (apply_note if note else apply)(data, subject, stored, stream_seq, headers)
        if result is Applied.REJECTED and hidden is not None:
            parts = subject.split(".")
            # only a subject a valid message can arrive on can hide one
            if len(parts) == 5 and parts[0] == prefix and parts[4] in (notes if note else kinds):
                hidden.add(subject)

    return on_event
