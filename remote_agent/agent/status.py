"""
The drone's status as the agent knows it: lifecycle, gate, flags, payloads, snapshot

Synchronous and without I/O: every job of the agent reads and changes the
drone's status through this one object, and nothing here awaits, so a check
and the change it leads to happen in one step of the event loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable

from remote_agent.agent.state import Lifecycle
from remote_agent.protocol.events import DrainIntent, DroneEnd, DroneState, Payload, Snapshot

S = DroneState


class DroneStatus:
    """
    The drone's lifecycle and everything its snapshot and the gate depend on

    :param slots: the drone's slots until the startd reports its own
    :param started_at: when the agent started
    """

    def __init__(self, slots: int, started_at: dt.datetime) -> None:
        self.started_at = started_at
        self.lifecycle = Lifecycle(started_at)
        self.slots = slots
        #: the payloads running now, by job id
        self.payloads: dict[str, Payload] = {}
        #: the drain the drone follows, once one was accepted
        self.drain: DrainIntent | None = None
        #: the worker process, once started (its pid is in the snapshot)
        self.worker: asyncio.subprocess.Process | None = None
        self.gate_open = False
        #: the gate is shut for good (drain, release, exit): nothing opens it again
        self.sealed = False
        #: the handshake record was claimed (for this or an earlier incarnation's drain)
        self.claimed = False
        #: the manager released the drone before the agent came up
        self.released = False
        #: the handshake record was released, deleted or rewritten while the agent was
        #: up: the gate is shut and the agent never writes the record again
        self.record_lost: str | None = None
        #: why the drone ends its job as planned (drained, released), once it does
        self.ending: str | None = None
        #: the agent terminated the worker itself
        self.terminated = False
        #: the signal the batch system sent, if any
        self.stop_signal: int | None = None
        #: the worker has ended (or never started): no new activity begins
        self.winding_down = False
        #: when the batch system ends the drone, on the monotonic clock (``None``: unknown);
        #: it only ever moves up (``remote_agent/agent/lifetime.py``)
        self.end_at: float | None = None
        #: where the agent learned its end, and the signal that announced it, if one did
        self.end_source = ""
        self.end_notice = ""
        self._gate_listeners: list[Callable[[], None]] = []

    @property
    def state(self) -> DroneState:
        return self.lifecycle.state

    def move(self, wanted: DroneState) -> None:
        """Enter ``wanted`` (see :meth:`Lifecycle.move`)"""
        self.lifecycle.move(wanted)

    def snapshot(self) -> Snapshot:
        """The drone's whole state as the agent knows it now"""
        return Snapshot(
            state=self.lifecycle.state,
            since=self.lifecycle.since,
            gate_open=self.gate_open,
            slots=self.slots,
            payloads=list(self.payloads.values()),
            drain=self.drain,
            worker_pid=self.worker_pid,
            started_at=self.started_at,
            end=self._end(),
        )

    # ------------------------------------------------------------------ the end

    def _end(self) -> DroneEnd | None:
        left = self.end_left_s()
        if left is None:
            return None
        return DroneEnd(in_s=max(0.0, left), source=self.end_source, notice=self.end_notice)

    def end_left_s(self) -> float | None:
        """Seconds until the batch system ends the drone (negative once past); ``None``: unknown"""
        return None if self.end_at is None else self.end_at - time.monotonic()

    def end_refusal(self, runtime_s: float, margin_s: float) -> str | None:
        """
        Why a payload that runs ``runtime_s`` cannot start now: it would not end
        ``margin_s`` before the drone's end; ``None`` if it can, or no end is known
        """
        left = self.end_left_s()
        if left is None or runtime_s <= left - margin_s:
            return None
        return (
            f"it may run {runtime_s:.0f}s, and the drone's batch job ends in {max(0.0, left):.0f}s"
            f" ({margin_s:.0f}s of it kept for the drone's own end)"
        )

    # ------------------------------------------------------------------ worker

    @property
    def worker_pid(self) -> int | None:
        """The worker's pid while it runs"""
        worker = self.worker
        running = worker is not None and worker.returncode is None
        return worker.pid if running and worker is not None else None

    @property
    def worker_ended(self) -> bool:
        """Whether the worker has exited: then everything that ran under it has ended"""
        worker = self.worker
        return worker is not None and worker.returncode is not None

    # ------------------------------------------------------------------ gate

    def on_gate_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (synchronously) whenever the gate opens or shuts"""
        self._gate_listeners.append(listener)

    def open_gate(self) -> None:
        """Open the gate: the drone is idle or busy from now on"""
        self.gate_open = True
        self.lifecycle.move(S.BUSY if self.payloads else S.IDLE)
        self._gate_changed()

    def seal_gate(self) -> bool:
        """Shut the gate for good; ``True`` if it was open"""
        self.sealed = True
        was_open, self.gate_open = self.gate_open, False
        if was_open:
            self._gate_changed()
        return was_open

    def _gate_changed(self) -> None:
        for listener in self._gate_listeners:
            listener()

    def closed_reason(self) -> str:
        """Why the gate refuses a payload now"""
        state = self.lifecycle.state
        if self.released:
            return "the drone was released by its manager"
        if self.drain is not None:
            return f"the drone is draining ({self.drain.reason or 'no reason given'})"
        if state is S.DRAINED:
            return "the drone is drained and ending its job"
        if state is S.EXITING:
            return "the drone's agent is exiting"
        if not self.claimed:
            return "the gate is not open yet: waiting for the handshake with the manager"
        return "the gate is closed"

    # ------------------------------------------------------------------ payloads

    def payloads_changed(self) -> None:
        """Follow the payload table: idle <-> busy"""
        state = self.lifecycle.state
        if state is S.IDLE and self.payloads:
            self.lifecycle.move(S.BUSY)
        elif state is S.BUSY and not self.payloads:
            self.lifecycle.move(S.IDLE)

    def exiting(self) -> None:
        """Enter ``exiting`` unless the drone is there already"""
        if self.lifecycle.state is not S.EXITING:
            self.lifecycle.move(S.EXITING)
