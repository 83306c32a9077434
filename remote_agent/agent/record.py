"""The handshake record, from the drone's side: its calls, retried while the broker is away"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from remote_agent.agent.context import AgentContext
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.events import (
    DrainIntent,
    DroneState,
    RecordPhase,
)
from remote_agent.protocol.handshake import RecordStore, Versioned
from remote_agent.protocol.names import kv_stream, kv_subjects
from remote_agent.protocol.transient import Backoff, is_transient

log = logging.getLogger("remote_agent.agent")

S = DroneState


class RecordClient:
    """The drone's calls on its handshake record, retried while the broker is away"""

    def __init__(self, context: AgentContext) -> None:
        self._context = context
        self._store: RecordStore | None = None
        self._bound: JetStreamContext | None = None

    @property
    def bucket(self) -> str:
        """The handshake bucket's name"""
        return self._context.namespace.record_bucket

    async def store(self) -> RecordStore:
        """The handshake bucket, once connected"""
        context = self._context
        publisher = context.emitter.publisher
        assert publisher is not None
        await publisher.connected.wait()
        js = publisher.js
        assert js is not None
        # bound to the client's JetStream: a new client (a renewed identity) binds anew
        if self._store is None or self._bound is not js:
            self._bound = js
            bucket = context.namespace.record_bucket
            # bound without STREAM.INFO: a drone needs only a direct get and publishes
            # to its own key, no other JetStream API (docs/agent.md, permissions)
            kv = KeyValue(
                name=bucket, stream=kv_stream(bucket), pre=kv_subjects(bucket), js=js, direct=True
            )
            domain = context.settings.domain
            # the agent's own loops retry (and check meanwhile whether the drone was sealed):
            # the store waits out a blip only
            self._store = RecordStore(
                kv,
                context.namespace,
                js=js,
                domain=domain,
                transient_s=context.settings.reconnect_wait_s,
            )
        return self._store

    async def call(
        self, what: str, op: Callable[[RecordStore], Awaitable[Versioned]], budget_s: float = 30.0
    ) -> Versioned | None:
        """Run a record operation, retrying while the broker is away, for ``budget_s``"""
        deadline = time.monotonic() + budget_s
        backoff = Backoff(first=0.1, most=2.0)
        publisher = self._context.emitter.publisher
        while True:
            remaining = deadline - time.monotonic()
            if publisher is not None and publisher.refused is not None:
                log.info("cannot %s: off the bus", what, extra=self._context.extra)
                return None
            if remaining <= 0:
                log.warning("gave up to %s for now", what, extra=self._context.extra)
                return None
            try:
                store = await asyncio.wait_for(self.store(), remaining)
                return await asyncio.wait_for(op(store), remaining)
            except HandshakeError as err:
                log.warning("cannot %s: %s", what, err, extra=self._context.extra)
                return None
            except (nats.errors.Error, OSError, TimeoutError) as err:
                if not is_transient(err):  # refused: asking again gets the same answer
                    log.warning("cannot %s: %r", what, err, extra=self._context.extra)
                    return None
                log.debug("cannot %s yet: %r", what, err, extra=self._context.extra)
            await asyncio.sleep(min(backoff.delay(), max(0.0, deadline - time.monotonic())))

    async def finish(self, phase: RecordPhase, note: str, budget_s: float = 30.0) -> None:
        """Let the record say ``phase`` (drained, deadline expired), unless it is not ours"""
        context = self._context
        if context.status.released or context.status.record_lost is not None:
            return
        assert phase in (RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED)
        site, drone, incarnation = context.site, context.drone, context.incarnation
        await self.call(
            f"record {phase}",
            lambda store: store.finish(site, drone, incarnation, phase, note),
            budget_s,
        )

    async def request_drain(self, intent: DrainIntent) -> None:
        """Record a drain intent that came as a command"""
        site, drone = self._context.site, self._context.drone
        await self.call(
            "record the drain intent",
            lambda store: store.request_drain(site, drone, intent, writer="agent"),
        )
