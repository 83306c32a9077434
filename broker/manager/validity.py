"""
The validity rule of a stored message: what the registry, a rebuild and the timeline accept

An event is valid if it is at most the size limit, passes the strict decoder, speaks
for the site, drone and kind of its subject, and, when it came off the stream, was
stored as its writer published it. Whether a message is valid depends on its subject,
bytes and headers alone, so the state of a drone is a function of its stored messages.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Final, TypeVar

from broker.errors import Rejected
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import AnyEvent, decode_event, sender_mismatch
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import MSG_ID, RELAY_HEADERS


class Rejection(enum.StrEnum):
    """Why an event or record was rejected (the label of its counter)"""

    OVERSIZED = "oversized"  #: larger than the configured limit
    MALFORMED = "malformed"  #: not a valid message of the schema (type, field, version)
    SUBJECT = "subject"  #: arrived on a subject that is not an event subject of ours
    SENDER = "sender"  #: the body speaks for another drone or kind than its subject
    RECORD = "record"  #: a KV value that is not a valid record for its key
    RELAYED = "relayed"  #: a server's answer that a reply subject sent onto this subject


class Unstored(enum.Enum):
    """A message that did not come off a stream (tests, tools): no headers to check"""

    UNSTORED = "unstored"


UNSTORED: Final = Unstored.UNSTORED
Headers = Mapping[str, str] | None | Unstored


def relayed(headers: Mapping[str, str] | None) -> bool:
    """Whether a stored message with ``headers`` is a server's answer relayed onto its subject"""
    return headers is not None and not RELAY_HEADERS.isdisjoint(headers)


def published_by_writer(headers: Mapping[str, str] | None, message_id: str) -> bool:
    """
    Whether a stored message is its writer's own publish: no server answer headers, and
    the ``Nats-Msg-Id`` its writer sends (``message_id``, the message's ``id``)
    """
    return (
        headers is not None
        and headers.get(MSG_ID) == message_id
        and RELAY_HEADERS.isdisjoint(headers)
    )


_T = TypeVar("_T")


def decoded(data: bytes, max_size: int, headers: Headers, decode: Callable[[bytes, int], _T]) -> _T:
    """
    ``data`` decoded strictly by ``decode``, if it is no relayed server answer and fits

    :raises Rejected: ``relayed``, ``oversized`` or ``malformed``
    """
    if headers is not UNSTORED and relayed(headers):
        raise Rejected(Rejection.RELAYED, "a server's answer, relayed by a reply subject")
    if len(data) > max_size:
        raise Rejected(
            Rejection.OVERSIZED, f"{len(data)} bytes exceed the limit of {max_size} bytes"
        )
    try:
        return decode(data, max_size)
    except SchemaError as err:
        raise Rejected(Rejection.MALFORMED, str(err)) from None


def check_writer(headers: Headers, message_id: str) -> None:
    """
    :raises Rejected: ``relayed`` if a stored message is not its writer's own publish
        (:func:`published_by_writer`)
    """
    if headers is not UNSTORED and not published_by_writer(headers, message_id):
        raise Rejected(Rejection.RELAYED, f"stored without its writer's {MSG_ID}")


def check_event(
    data: bytes,
    subject: str,
    prefix: str,
    max_size: int = DEFAULT_MAX_SIZE,
    headers: Headers = UNSTORED,
) -> AnyEvent:
    """
    The event in ``data`` if it is valid as it arrived on ``subject`` with ``headers``

    Valid means: at most ``max_size`` bytes, a message of the schema (strict
    decoding, see :func:`remote_agent.protocol.events.decode_event`), speaking for the
    site, drone and kind that its subject names, and, when it came off the
    stream, stored as its writer published it (:func:`published_by_writer`).
    Depends on nothing else, so the live registry, a rebuild and the timeline
    all accept the same events.

    :param headers: the headers it was stored with (``None``: none), or
        :data:`UNSTORED` for an event that did not come off a stream
    :raises Rejected: with the reason otherwise
    """
    event = decoded(data, max_size, headers, decode_event)
    try:
        mismatch = sender_mismatch(event, subject, prefix)
    except SchemaError:
        raise Rejected(Rejection.SUBJECT, "not an event subject") from None
    if mismatch is not None:
        raise Rejected(Rejection.SENDER, mismatch)
    check_writer(headers, event.id)
    return event
