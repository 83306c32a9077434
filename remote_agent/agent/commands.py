"""
The command server: the manager's commands on the drone's subject, and their replies

A drain and a status are carried out without an await; release-if-idle asks
the startd and then decides in one synchronous step, so a payload start and
a command never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
from nats.aio.msg import Msg

from remote_agent.agent.bounds import bounded_intent, cut
from remote_agent.agent.context import AgentContext
from remote_agent.agent.drain import Drain
from remote_agent.agent.steering import Steering
from remote_agent.agent.watch import RecordWatch
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import (
    DrainCommand,
    Drained,
    DrainIntent,
    DroneState,
    ErrorReply,
    GateClosed,
    Outcome,
    RecordPhase,
    ReleaseIfIdleCommand,
    Reply,
    StatusCommand,
    decode_command,
    encode,
    kind_of,
)
from remote_agent.protocol.fields import MAX_REQUEST_ID, MAX_TEXT

log = logging.getLogger("remote_agent.agent")

S = DroneState

#: how long a command reply waits for the record write of a release-if-idle
_REPLY_RECORD_WAIT_S = 2.0


class CommandServer:
    """
    Serves the drone's command subject (and subscribes the record hints with it)

    :param watch: hinted at every write attempt on the drone's record, and told
        (:attr:`RecordWatch.listening`) once both subscriptions are in
    """

    def __init__(
        self,
        context: AgentContext,
        steering: Steering,
        drain: Drain,
        watch: RecordWatch,
    ) -> None:
        self._context = context
        self._steering = steering
        self._drain = drain
        self._watch = watch
        self._release_recorded: asyncio.Event | None = None

    async def serve(self) -> None:
        """Subscribe to the command subject and to writes of the own record"""
        context = self._context
        publisher = context.emitter.publisher
        assert publisher is not None
        await publisher.connected.wait()
        await publisher.subscribe(
            context.namespace.command(context.site, context.drone), self._on_command
        )
        # A core subscription on the key's subject sees every write attempt, also ones the
        # stream refused, so it is only a hint to re-read the record; the client replays
        # it after a reconnect, the publisher on a new client. (A KV watch would need the
        # consumer API.)
        subject = context.namespace.record_subject(context.site, context.drone)
        await publisher.subscribe(subject, self._on_hint)
        nc = publisher.nc
        assert nc is not None
        while True:  # the server has the subscriptions once a flush returns
            try:
                await nc.flush()
                break
            except (nats.errors.Error, TimeoutError) as err:
                log.debug("subscriptions not flushed yet: %r", err, extra=context.extra)
                await asyncio.sleep(context.settings.reconnect_wait_s)
        self._watch.listening.set()

    async def _on_hint(self, msg: Msg) -> None:
        self._watch.hint()

    async def _on_command(self, msg: Msg) -> None:
        try:
            await self._command(msg)
        except Exception:
            self._context.counters["internal_errors"] += 1
            log.exception("command handling failed", extra=self._context.extra)

    async def _command(self, msg: Msg) -> None:
        context = self._context
        if not msg.reply:
            context.counters["command_errors"] += 1
            log.warning("a command without reply subject; ignored", extra=context.extra)
            return
        try:
            command = decode_command(msg.data)
        except SchemaError as err:
            await self._reject(msg.reply, str(err), "")
            return
        if (command.site, command.drone) != (context.site, context.drone):
            await self._reject(
                msg.reply,
                f"command for {command.site}/{command.drone} reached the agent of "
                f"{context.site}/{context.drone}",
                command.request_id,
            )
            return
        if isinstance(command, ReleaseIfIdleCommand):
            outcome, detail = await self._release_if_idle()
        else:
            outcome, detail = self._execute(command)
        context.counters["commands"] += 1
        log.info(
            "%s %s: %s (%s)",
            kind_of(type(command)),
            command.request_id,
            outcome,
            detail,
            extra={"drone": context.drone, "request_id": command.request_id},
        )
        recorded = self._release_recorded
        if outcome is Outcome.RELEASED and recorded is not None:
            # let the record say "drained" before the manager hears "released", if quick
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(recorded.wait(), _REPLY_RECORD_WAIT_S)
        reply = Reply(
            site=context.site,
            drone=context.drone,
            request_id=cut(command.request_id, MAX_REQUEST_ID),
            outcome=outcome,
            detail=cut(detail, MAX_TEXT),
            snapshot=context.status.snapshot(),
        )
        await self._send_reply(msg.reply, encode(reply))

    async def _reject(self, reply_to: str, error: str, request_id: str) -> None:
        self._context.counters["command_errors"] += 1
        log.warning("rejected a command: %s", error, extra=self._context.extra)
        reply = ErrorReply(error=cut(error, MAX_TEXT), request_id=cut(request_id, MAX_REQUEST_ID))
        await self._send_reply(reply_to, encode(reply))

    async def _send_reply(self, reply_to: str, data: bytes) -> None:
        publisher = self._context.emitter.publisher
        assert publisher is not None
        nc = publisher.nc
        if nc is None:
            return
        try:
            # not msg.respond(): that would echo the request's headers
            # (nats.py nats/aio/msg.py: respond publishes with headers=self.headers)
            await nc.publish(reply_to, data)
        except (nats.errors.Error, OSError) as err:
            log.warning("cannot send a reply: %r", err, extra=self._context.extra)

    def _execute(self, command: DrainCommand | StatusCommand) -> tuple[Outcome, str]:
        """Carry out a command at once (no await), so it is ordered with the gate"""
        if isinstance(command, DrainCommand):
            intent = DrainIntent(
                deadline=command.deadline,
                reason=command.reason,
                request_id=command.request_id,
                requested_at=command.at,
            )
            return self._drain.accept(bounded_intent(intent), command=True)
        assert isinstance(command, StatusCommand)
        status = self._context.status
        return Outcome.STATUS, f"{status.state}, {len(status.payloads)} payload(s)"

    def _release_known(self) -> tuple[Outcome, str] | None:
        """The answer to release-if-idle that needs no look at the startd, if any"""
        status = self._context.status
        if status.released:
            return Outcome.RELEASED, "released by the manager before the agent came up"
        if status.payloads:
            return Outcome.BUSY, f"{len(status.payloads)} payload(s) running; nothing changed"
        if status.state is S.DRAINED:
            # the drained state required the startd's word already
            return Outcome.RELEASED, "idle, gate closed; the drone is ending its job"
        return None

    async def _release_if_idle(self) -> tuple[Outcome, str]:
        """
        Release the drone only if the startd, not just the hooks, says nothing runs

        Serialized with payload starts: the admission count is remembered, the
        startd asked, and then in one synchronous step the drone is refused
        (BUSY) if anything was admitted meanwhile or the startd lists anything
        busy, else the gate is sealed.
        """
        known = self._release_known()
        if known is not None:
            return known
        admitted = self._steering.ledger.admitted
        busy = await self._steering.startd.busy()
        # ---- from here to the return nothing awaits
        known = self._release_known()
        if known is not None:
            return known
        if self._steering.ledger.admitted != admitted:
            return Outcome.BUSY, "a payload started meanwhile; nothing changed"
        if busy is None:
            return Outcome.BUSY, "the startd does not answer and the worker runs; nothing changed"
        if busy:
            listed = ", ".join(
                f"{slot.name} {slot.state}/{slot.activity} {slot.job_id or '-'}"
                for slot in busy[:8]
            )
            return Outcome.BUSY, cut(
                f"the startd lists {len(busy)} busy slot(s): {listed}; nothing changed", MAX_TEXT
            )
        status = self._context.status
        if status.drain is not None or status.ending is not None:
            return Outcome.RELEASED, "idle, gate closed; the drone is ending its job"
        if status.state is S.EXITING:
            return Outcome.RELEASED, "idle; the agent is exiting"
        was_open = status.seal_gate()
        status.move(S.DRAINED)
        if was_open:
            self._context.emitter.emit(GateClosed, reason="release if idle")
        self._context.emitter.emit(Drained)
        self._release_recorded = asyncio.Event()
        self._context.tasks.spawn(self._end_after_release(self._release_recorded), "release")
        return Outcome.RELEASED, "idle; gate closed, the drone is ending its job"

    async def _end_after_release(self, recorded: asyncio.Event) -> None:
        await self._steering.record.finish(RecordPhase.DRAINED, "released while idle")
        recorded.set()
        await self._steering.startd.stop("released while idle")
        await self._steering.worker.end_job(
            "released while idle", exits_itself=self._steering.startd.exits_when_empty
        )
