"""
:class:`TardisStateNotes`: a TARDIS plugin that queues every drone's state change as a note

The plugin only queues (:meth:`~broker.tardis.bus.RemoteBus.note_state`); it never raises.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from tardis.interfaces.plugin import Plugin
from tardis.utilities.attributedict import AttributeDict

from broker.tardis.bus import RemoteBus
from broker.tardis.config import site_token

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")


def _status_name(value: object) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    return "" if value is None else str(value)


class TardisStateNotes(Plugin):
    """
    A TARDIS plugin: every state transition of every drone, as a manager note

    TARDIS awaits plugins inside the drone's own task, one after another, and
    an exception there aborts the daemon: :meth:`notify` only queues the note.
    """

    def __init__(self, bus: RemoteBus) -> None:
        self.bus = bus

    async def notify(self, state: Any, resource_attributes: AttributeDict) -> None:
        try:
            drone = str(resource_attributes["drone_uuid"])
            site = self.bus.sites.get(drone) or site_token(str(resource_attributes["site_name"]))
            self.bus.note_state(
                site,
                drone,
                str(state),
                _status_name(resource_attributes.get("resource_status")),
            )
        except Exception:
            log.exception("cannot note a TARDIS state change")
