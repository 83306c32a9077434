"""The worst-case event of every kind fits the stream's message size limit"""

from __future__ import annotations

import datetime as dt
import typing
from pathlib import Path
from typing import Any

from remote_agent.agent import Agent
from remote_agent.agent.bounds import bounded_command, bounded_intent
from remote_agent.protocol import events as ev
from remote_agent.protocol.fields import (
    DEFAULT_MAX_SIZE,
    MAX_COMMAND,
    MAX_JOB_ID,
    MAX_NAME,
    MAX_PAYLOADS,
    MAX_REQUEST_ID,
    MAX_TEXT,
)
from remote_agent.settings import Settings
from remote_agent.spool import SpooledEvent

LONGEST_TOKEN = 128  # fields.Token
HUGE = "x" * 100_000


class Capture:
    """Stands in for the spool and the publisher: keeps what the agent would publish"""

    def __init__(self) -> None:
        self.entries: list[SpooledEvent] = []

    def append(self, entry: SpooledEvent) -> None:
        self.entries.append(entry)

    def wake(self) -> None:
        pass


def _worst_agent(tmp_path: Path) -> tuple[Agent, Capture]:
    site, drone = "s" * LONGEST_TOKEN, "d" * LONGEST_TOKEN
    settings = Settings(
        site=site,
        drone=drone,
        servers=("nats://127.0.0.1:1",),
        worker_command=("condor_master", *(["-" * 1000] * 100)),
        spool_dir=tmp_path / "spool",
        gate_socket=tmp_path / "gate.sock",
        startd=False,
        slots=10_000,
    )
    agent = Agent(settings)
    capture = Capture()
    agent.emitter.spool = capture  # type: ignore[assignment]
    agent.emitter.publisher = capture  # type: ignore[assignment]
    now = ev.utcnow()
    for n in range(MAX_PAYLOADS):
        job_id = f"{n:04d}".rjust(MAX_JOB_ID, "9")
        agent.status.payloads[job_id] = ev.Payload(
            job_id=job_id, slot="s" * MAX_NAME, started_at=now, requested_s=1e300
        )
    # the longest words the agent puts into the drone's end
    agent.status.end_at, agent.status.end_source, agent.status.end_notice = (
        1e300,
        "SLURM_JOB_END_TIME",
        "SIGUSR2",
    )
    agent.status.drain = bounded_intent(
        ev.DrainIntent(deadline=now, reason=HUGE, request_id=HUGE, requested_at=now)
    )
    return agent, capture


def test_strings_and_commands_are_cut() -> None:
    now = ev.utcnow()
    intent = bounded_intent(
        ev.DrainIntent(deadline=now, reason=HUGE, request_id=HUGE, requested_at=now)
    )
    assert len(intent.reason) == MAX_TEXT and len(intent.request_id) == MAX_REQUEST_ID
    command = bounded_command(["a" * 3000, "b" * 3000, "c"])
    assert sum(map(len, command)) <= MAX_COMMAND and command[0] == "a" * 3000


def test_the_worst_case_event_of_every_kind_fits(tmp_path: Path) -> None:
    agent, capture = _worst_agent(tmp_path)
    now = ev.utcnow()
    intent = agent.status.drain
    assert intent is not None
    long_command = bounded_command(agent.settings.worker_command)
    fields: dict[type[ev.Event], dict[str, Any]] = {
        ev.AgentStarted: {
            "agent_version": "9" * 32,
            "hostname": "h" * MAX_NAME,
            "pid": 2**31,
            "worker_command": long_command,
        },
        ev.WorkerStarted: {"pid": 2**31, "command": long_command},
        ev.WorkerExited: {"pid": 2**31, "exit_code": 255, "signal": 64},
        ev.StartdReady: {"slots": 2**31, "name": "n" * MAX_NAME},
        ev.PayloadStarted: {"job_id": "j" * MAX_JOB_ID, "slot": "s" * MAX_NAME},
        ev.PayloadFinished: {
            "job_id": "j" * MAX_JOB_ID,
            "slot": "s" * MAX_NAME,
            "how": ev.PayloadEnd.UNKNOWN,
            "exit_code": -(2**31),
            "duration_s": 1e300,
        },
        ev.GateOpened: {"reason": HUGE},
        ev.GateClosed: {"reason": HUGE},
        ev.DrainRequested: {"intent": intent},
        ev.DrainAccepted: {"intent": intent, "payloads": MAX_PAYLOADS},
        ev.DrainRefused: {"request_id": HUGE, "reason": HUGE},
        ev.Draining: {"payloads": MAX_PAYLOADS, "deadline": now + dt.timedelta(days=9999)},
        ev.Drained: {},
        ev.DrainDeadlineExpired: {"payloads": MAX_PAYLOADS, "action": "wait"},
        ev.Released: {"reason": HUGE},
        ev.AgentExiting: {"exit_code": 255, "reason": HUGE},
        ev.Heartbeat: {"interval_s": 1e300},
    }
    # every kind of event is in the table
    assert set(fields) == set(typing.get_args(ev.AnyEvent))
    agent.emitter.seq = 2**63 - 1 - len(fields)
    for kind, values in fields.items():
        agent.emitter.emit(kind, **values)
    sizes = {entry.kind: len(entry.data) for entry in capture.entries}
    assert len(sizes) == len(fields)
    assert max(sizes.values()) <= DEFAULT_MAX_SIZE, sizes
    # with room to spare (50 KB today): a tenth of the limit is left
    assert max(sizes.values()) <= DEFAULT_MAX_SIZE * 0.9, sizes
    for entry in capture.entries:
        decoded = ev.decode_event(entry.data)
        assert len(decoded.snapshot.payloads) == MAX_PAYLOADS
    # a reply carries the same snapshot and a cut detail
    reply = ev.Reply(
        site=agent.settings.site,
        drone=agent.settings.drone,
        request_id="r" * MAX_REQUEST_ID,
        outcome=ev.Outcome.ALREADY_DRAINING,
        detail="d" * MAX_TEXT,
        snapshot=agent.snapshot(),
    )
    assert len(ev.encode(reply)) <= DEFAULT_MAX_SIZE * 0.9
