"""
The agent's events: each one numbered, with the snapshot after it, spooled, then published

The emitter owns the drone's link to the bus (the spool and the ordered
publisher, from :meth:`Emitter.attach` on); the other jobs reach the
connection through it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from remote_agent.agent.bounds import cut
from remote_agent.agent.status import DroneStatus
from remote_agent.protocol.events import Event, Heartbeat, encode, kind_of, utcnow
from remote_agent.protocol.fields import MAX_TEXT
from remote_agent.protocol.names import Namespace, dedupe_id
from remote_agent.publisher import Publisher
from remote_agent.settings import Settings
from remote_agent.spool import Spool, SpooledEvent

log = logging.getLogger("remote_agent.agent")

E = TypeVar("E", bound=Event)


class Emitter:
    """Turns what happens to the drone into events on the spool, and wakes the publisher"""

    def __init__(
        self,
        settings: Settings,
        namespace: Namespace,
        incarnation: str,
        status: DroneStatus,
        counters: Counter[str],
    ) -> None:
        self.namespace = namespace
        self.incarnation = incarnation
        self.status = status
        self.counters = counters
        self._site = settings.site
        self._drone = settings.drone
        #: the last sequence number used
        self.seq = 0
        self.spool: Spool | None = None
        self.publisher: Publisher | None = None

    def attach(self, spool: Spool, publisher: Publisher, seq: int) -> None:
        """Emit to ``spool`` and wake ``publisher``, numbering above ``seq``"""
        self.spool = spool
        self.publisher = publisher
        self.seq = seq

    def emit(self, kind: type[E], **fields: Any) -> E:
        """Record an event with the snapshot after it, and queue it for publishing"""
        assert self.spool is not None and self.publisher is not None
        for name, value in fields.items():
            if isinstance(value, str) and len(value) > MAX_TEXT:
                self.counters["strings_cut"] += 1
                fields[name] = cut(value, MAX_TEXT)
        self.seq += 1
        seq = self.seq
        event_id = dedupe_id(self._drone, self.incarnation, seq)
        event = kind(
            site=self._site,
            drone=self._drone,
            incarnation=self.incarnation,
            seq=seq,
            at=utcnow(),
            id=event_id,
            snapshot=self.status.snapshot(),
            **fields,
        )
        tag = kind_of(kind)
        self.spool.append(
            SpooledEvent(
                id=event_id,
                seq=seq,
                kind=tag,
                subject=self.namespace.event(self._site, self._drone, tag),
                data=encode(event),
            )
        )
        self.publisher.wake()
        log.log(
            logging.DEBUG if tag == "heartbeat" else logging.INFO,
            "%s (state %s)",
            tag,
            self.status.state,
            extra={"drone": self._drone, "seq": seq, "event": tag},
        )
        return event

    async def settled(self) -> None:
        """Return once every event emitted so far is on disk"""
        if self.spool is not None:
            await self.spool.synced()

    async def heartbeats(self, interval_s: float, on_beat: Callable[[], None]) -> None:
        """A heartbeat every ``interval_s`` until the agent winds down; ``on_beat`` after each"""
        while not self.status.winding_down:
            await asyncio.sleep(interval_s)
            self.emit(Heartbeat, interval_s=interval_s)
            on_beat()
