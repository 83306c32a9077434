"""
Fake drones for the registry tests: they speak the real wire schema

A :class:`FakeDrone` makes the events an agent would publish (full snapshots,
per-drone ``seq``, dedupe ids) and publishes them to the real stream with
``Nats-Msg-Id``. :func:`answer_commands` is a fake agent's command responder:
a plain subscription on the drone's command subject replying with ``Reply``.
Neither mocks NATS.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace, dedupe_id

T0 = dt.datetime(2026, 3, 18, 12, 0, tzinfo=dt.UTC)


@dataclass
class FakeDrone:
    site: str
    drone: str
    incarnation: str = "inc1"
    seq: int = 1000
    state: ev.DroneState = ev.DroneState.STARTING
    gate_open: bool = False
    payloads: list[ev.Payload] = field(default_factory=list)
    drain: ev.DrainIntent | None = None
    clock: dt.datetime = T0
    #: when the agent started, by its own clock
    started_at: dt.datetime = T0

    def snapshot(self) -> ev.Snapshot:
        return ev.Snapshot(
            state=self.state,
            since=self.clock,
            gate_open=self.gate_open,
            slots=4,
            payloads=list(self.payloads),
            drain=self.drain,
            worker_pid=4711,
            started_at=self.started_at,
        )

    def _head(self) -> dict[str, object]:
        self.seq += 1
        self.clock += dt.timedelta(seconds=1)
        return {
            "site": self.site,
            "drone": self.drone,
            "incarnation": self.incarnation,
            "seq": self.seq,
            "at": self.clock,
            "id": dedupe_id(self.drone, self.incarnation, self.seq),
        }

    def _event(self, kind: type[ev.Event], **fields: object) -> ev.Event:
        head = self._head()
        return kind(**head, snapshot=self.snapshot(), **fields)

    # the lifecycle, each step one event with the state it led to
    def started(self) -> ev.Event:
        self.state = ev.DroneState.STARTING
        return self._event(ev.AgentStarted, agent_version="test", pid=42)

    def ready(self) -> ev.Event:
        """The startd ready and the gate open at once (``startd_ready``, then ``gate_opened``)"""
        self.state, self.gate_open = ev.DroneState.IDLE, True
        return self._event(ev.StartdReady, slots=4)

    def worker_up(self) -> ev.Event:
        self.state = ev.DroneState.WORKER_UP
        return self._event(ev.WorkerStarted, pid=4711, command=["condor_master", "-f"])

    def startd_ready(self) -> ev.Event:
        """The startd answers; the gate stays shut until the handshake claim"""
        self.state = ev.DroneState.STARTD_READY
        return self._event(ev.StartdReady, slots=4)

    def gate_opened(self) -> ev.Event:
        self.state, self.gate_open = ev.DroneState.IDLE, True
        return self._event(ev.GateOpened, reason="handshake record claimed")

    def heartbeat(self, interval_s: float = 30.0) -> ev.Event:
        return self._event(ev.Heartbeat, interval_s=interval_s)

    def payload_started(self, job_id: str) -> ev.Event:
        self.clock += dt.timedelta(seconds=1)
        self.payloads.append(ev.Payload(job_id=job_id, slot="slot1_1", started_at=self.clock))
        self.state = ev.DroneState.BUSY
        return self._event(ev.PayloadStarted, job_id=job_id)

    def payload_finished(
        self,
        job_id: str,
        how: ev.PayloadEnd = ev.PayloadEnd.EXIT,
        exit_code: int | None = None,
        duration_s: float | None = None,
    ) -> ev.Event:
        self.payloads = [p for p in self.payloads if p.job_id != job_id]
        if self.state is ev.DroneState.BUSY and not self.payloads:
            self.state = ev.DroneState.IDLE
        return self._event(
            ev.PayloadFinished, job_id=job_id, how=how, exit_code=exit_code, duration_s=duration_s
        )

    def worker_exited(self, exit_code: int = 1) -> ev.Event:
        """The worker ended by itself; the gate shuts"""
        self.gate_open = False
        return self._event(ev.WorkerExited, pid=4711, exit_code=exit_code)

    def drained(self) -> ev.Event:
        self.state, self.gate_open = ev.DroneState.DRAINED, False
        return self._event(ev.Drained)

    def exiting(self) -> ev.Event:
        self.state, self.gate_open = ev.DroneState.EXITING, False
        return self._event(ev.AgentExiting, exit_code=0)

    def subject(self, event: ev.Event, namespace: Namespace) -> str:
        return namespace.event(self.site, self.drone, ev.kind_of(type(event)))


async def publish(js: JetStreamContext, namespace: Namespace, event: ev.Event) -> int:
    """Publish like an agent does; returns the stream sequence"""
    subject = namespace.event(event.site, event.drone, ev.kind_of(type(event)))
    ack = await js.publish(subject, ev.encode(event), headers={"Nats-Msg-Id": event.id})
    return ack.seq


async def answer_commands(
    nc: Client,
    namespace: Namespace,
    drone: FakeDrone,
    decide: Callable[[ev.AnyCommand], tuple[ev.Outcome, str]],
    seen: list[ev.AnyCommand] | None = None,
) -> Subscription:
    """A fake agent's command responder on the drone's command subject"""

    async def on_command(msg: Msg) -> None:
        command = ev.decode_command(msg.data)
        if seen is not None:
            seen.append(command)
        outcome, detail = decide(command)
        reply = ev.Reply(
            site=drone.site,
            drone=drone.drone,
            request_id=command.request_id,
            outcome=outcome,
            detail=detail,
            snapshot=drone.snapshot(),
        )
        await nc.publish(msg.reply, ev.encode(reply))

    return await nc.subscribe(namespace.command(drone.site, drone.drone), cb=on_command)
