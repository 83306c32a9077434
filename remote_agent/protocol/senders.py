"""The one sender rule: an event speaks only for the site, drone and kind of its subject"""

from __future__ import annotations

from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import EVENT_KINDS, Event
from remote_agent.protocol.names import Namespace, event_subject


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
