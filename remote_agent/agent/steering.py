"""What the drain, the record watch and the command server act through"""

from __future__ import annotations

from dataclasses import dataclass

from remote_agent.agent.payloads import PayloadLedger
from remote_agent.agent.record import RecordClient
from remote_agent.agent.startd import StartdObserver
from remote_agent.agent.worker import Worker


@dataclass(frozen=True)
class Steering:
    """The jobs that steer the drone: its payloads, its record, its startd, its worker"""

    ledger: PayloadLedger
    record: RecordClient
    startd: StartdObserver
    worker: Worker
