"""
The two ways an event-stream message reaches the registry: the durable consumer's
handler and the rebuild's reader

Both take a message's time and order from the stream (its reply subject), so a
replay after a restart sees the same times and the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from broker.jetstream.messages import Disposition, Handler, metadata
from broker.manager.notes import TARDIS_STATE, is_note_subject
from broker.manager.registry import Applied, Registry
from remote_agent.protocol.events import EVENT_TYPES, kind_of

#: what the registry's ``apply_message`` and ``apply_note_message`` take
_Apply = Callable[[bytes, str, float, int | None, Mapping[str, str] | None], Applied]


def note_handler(registry: Registry) -> Handler:
    """The notes consumer's handler: apply each TARDIS state note, then ack or term"""
    return _stored_handler(registry.apply_note_message)


def event_handler(registry: Registry) -> Handler:
    """
    The consumer's handler: apply each event to ``registry``, then say ack or term

    The event's time of arrival is the time the stream stored it (from the
    reply subject), so a replay after a restart sees the same times.
    Rejected events are termed: redelivering them could never help.
    """
    return _stored_handler(registry.apply_message)


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
