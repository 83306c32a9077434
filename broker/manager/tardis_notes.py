"""
The validity rule of a stored TARDIS state note, which the registry reads to see a drone's end

A note is valid if it is at most the size limit, passes the strict decoder, arrived on the
``tardis_state`` note subject of the site and drone it names, and was stored as the manager
published it. Only the manager's users may publish there; the checks are the same as for
events all the same, since a server's answer relayed by a reply subject lands there too.
"""

from __future__ import annotations

import sys

import msgspec

from broker.errors import Rejected
from broker.manager.lifecycle import TARDIS_DOWN
from broker.manager.validity import UNSTORED, Headers, Rejection, check_writer, decoded
from broker.manager.views import DroneView
from remote_agent.protocol.events import TARDIS_STATE, TardisState, decode_note
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import Namespace


def check_note(
    data: bytes,
    subject: str,
    prefix: str,
    max_size: int = DEFAULT_MAX_SIZE,
    headers: Headers = UNSTORED,
) -> TardisState:
    """
    The TARDIS state note in ``data`` if it is valid as stored on ``subject`` with ``headers``

    :param headers: as for :func:`broker.manager.validity.check_event`
    :raises Rejected: with the reason otherwise
    """
    note = decoded(data, max_size, headers, decode_note)
    if subject != Namespace(prefix).manager_note(note.site, note.drone, TARDIS_STATE):
        raise Rejected(
            Rejection.SENDER, f"note for {note.site}/{note.drone} arrived on {subject!r}"
        )
    check_writer(headers, note.id)
    return note


def noted_view(
    old: DroneView | None, note: TardisState, stored_time: float, stream_seq: int | None
) -> DroneView | None:
    """
    The view after the valid ``note``, or ``None`` if it changes nothing

    Only the newest note that no agent event follows in the stream counts; a note
    of a drone nothing is known about counts only if it says TARDIS gave the drone
    up (then its end is known).
    """
    newest = (
        0
        if old is None
        else max(old.stream_seq or 0, old.heartbeat_stream_seq or 0, old.tardis_seq or 0)
    )
    if stream_seq is None:
        stream_seq = newest + 1
    if (old is None and note.state != TARDIS_DOWN) or stream_seq <= newest:
        return None
    return msgspec.structs.replace(
        old or DroneView(site=sys.intern(note.site), drone=note.drone),
        tardis_seq=stream_seq,
        tardis_state=sys.intern(note.state),
        tardis_time=stored_time,
    )
