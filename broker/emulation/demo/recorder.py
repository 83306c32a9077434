"""
A TARDIS observer that writes every drone state transition to a JSON-lines file

Its rule: TARDIS's view is recorded inside the daemon, independent of the bus, so the stock
and the decorated run are measured the same way.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from pathlib import Path
from typing import Any

from tardis.interfaces.plugin import Plugin

log = logging.getLogger("cobald.runtime.emulation.recorder")


class StateRecorder(Plugin):
    """
    Loaded through ``create_composite_pool(observers=...)``::

        observers: {"broker.emulation.demo.recorder:StateRecorder": {path: /run/dir/tardis.jsonl}}

    One object per line: ``t`` (epoch seconds), ``drone``, ``job_id``, ``state`` (class name),
    ``resource_status`` (name).
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    async def notify(self, state: Any, resource_attributes: Any) -> None:
        try:
            status = resource_attributes.get("resource_status")
            line = {
                "t": time.time(),
                "drone": resource_attributes["drone_uuid"],
                "job_id": resource_attributes.get("remote_resource_uuid"),
                "state": str(state),
                "resource_status": status.name if isinstance(status, enum.Enum) else str(status),
            }
            with self.path.open("a", encoding="utf-8") as stream:  # one short write per change
                stream.write(json.dumps(line) + "\n")
        except Exception:  # a plugin that raises aborts the daemon
            log.exception("cannot record a TARDIS state")
