"""
The removal verdict: the only place that says a drone's batch job may be removed

It answers yes in exactly the four safe cases of the design (``docs/architecture.md``,
"Control API"): the manager released the drone before its agent came up (with the
manager's proof); the agent recorded ``drained`` and its newest event lists no
payload; the agent's drain deadline expired, and by the manager's own reckoning too
(:attr:`~broker.manager.views.RecordView.drain_due`); or the agent is lost **and** the
local batch system says the job is not running. Every time it compares is the manager's
or the bus's: no drone's clock decides a removal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from broker.manager.views import DroneView
from remote_agent.protocol.events import RecordPhase


class Removal(enum.StrEnum):
    """Why a drone's batch job may or may not be removed"""

    # the four safe cases
    RELEASED_BY_MANAGER = "released_by_manager"
    DRAINED_BY_AGENT = "drained_by_agent"
    DEADLINE_EXPIRED = "deadline_expired"
    LOST_AND_NOT_RUNNING = "lost_and_not_running"
    # everything else
    UNKNOWN_DRONE = "unknown_drone"
    NOT_ANNOUNCED = "not_announced"
    AGENT_UP = "agent_up"
    DRAINING = "draining"
    LOST_BUT_RUNNING = "lost_but_running"
    LOST_LBS_UNKNOWN = "lost_lbs_unknown"
    UNEXPECTED_WRITER = "unexpected_writer"
    UNPROVEN_RELEASE = "unproven_release"
    RECORD_TAMPERED = "record_tampered"
    DRAINED_BUT_BUSY = "drained_but_busy"
    DEADLINE_NOT_DUE = "deadline_not_due"


SAFE_REMOVALS: Final = frozenset(
    {
        Removal.RELEASED_BY_MANAGER,
        Removal.DRAINED_BY_AGENT,
        Removal.DEADLINE_EXPIRED,
        Removal.LOST_AND_NOT_RUNNING,
    }
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer of :func:`removal_verdict`: yes only in the four safe cases"""

    allowed: bool
    reason: Removal
    detail: str

    def __bool__(self) -> bool:
        return self.allowed


def _no(reason: Removal, detail: str) -> Verdict:
    return Verdict(False, reason, detail)


def _yes(reason: Removal, detail: str) -> Verdict:
    assert reason in SAFE_REMOVALS
    return Verdict(True, reason, detail)


def removal_verdict(
    view: DroneView | None,
    lbs_running: bool | None,
    now: float,
    lost_after_s: float,
) -> Verdict:
    """
    Whether the batch job of the drone described by ``view`` may be removed

    :param view: the registry's view of the drone (``None``: nothing known)
    :param lbs_running: whether the local batch system reports the drone's job
        as running; ``None`` if unknown
    :param now: the current time, epoch seconds
    :param lost_after_s: seconds without a sign of life after which the agent
        counts as lost
    """
    if view is None:
        return _no(Removal.UNKNOWN_DRONE, "nothing is known about this drone: release it first")
    said = _by_record(view, now)
    if isinstance(said, Verdict):
        return said
    if view.is_lost(now, lost_after_s):
        return _when_lost(view, lbs_running, now)
    if said is not None:  # a final phase not to be trusted
        return _no(*said)
    record = view.record
    if record is None and up_without_record(view):
        return _no(
            Removal.RECORD_TAMPERED,
            "no handshake record, but its agent reports its gate open or payloads: "
            "the record was retired or removed; drain it",
        )
    if record is None:
        return _no(
            Removal.NOT_ANNOUNCED,
            "no handshake record: the agent may be about to claim; release it first",
        )
    if record.phase is RecordPhase.DRAINING:
        deadline = record.drain.deadline.isoformat() if record.drain else "?"
        return _no(Removal.DRAINING, f"draining until {deadline}; wait for drained")
    return _no(Removal.AGENT_UP, "the agent is up and may run payloads: drain it")


def up_without_record(view: DroneView | None) -> bool:
    """
    Whether the drone's agent reports itself past its claim (its gate open, or payloads)
    while the registry knows no record of it: its record was retired (or purged) while
    the agent was away. Such a drone is never released: its payloads may run.
    """
    if view is None or view.record is not None:
        return False
    snapshot = view.snapshot
    return snapshot is not None and (snapshot.gate_open or bool(snapshot.payloads))


def _by_record(view: DroneView, now: float) -> Verdict | tuple[Removal, str] | None:
    """A safe case the record proves, a final phase not to be trusted, or nothing"""
    record = view.record
    if record is None:
        return None
    phase, writer = record.phase, record.writer
    if phase is RecordPhase.RELEASED:
        if record.proven:
            return _yes(
                Removal.RELEASED_BY_MANAGER,
                "released before its agent came up: no payload can ever start",
            )
        return (Removal.UNPROVEN_RELEASE, "record released without the manager's proof")
    if phase is RecordPhase.DRAINED and writer == "agent":
        if not view.payloads:
            return _yes(Removal.DRAINED_BY_AGENT, "the agent is idle and has closed its gate")
        return (
            Removal.DRAINED_BUT_BUSY,
            f"record drained, but the agent's newest event lists {len(view.payloads)} payload(s)",
        )
    if phase is RecordPhase.DEADLINE_EXPIRED and writer == "agent":
        due = record.drain_due
        if due is not None and now >= due:
            return _yes(Removal.DEADLINE_EXPIRED, "the agent's drain deadline expired")
        if due is None:
            return (
                Removal.DEADLINE_NOT_DUE,
                "the agent says its drain deadline expired, but its record holds no drain"
                " the manager can count: wait for drained",
            )
        return (
            Removal.DEADLINE_NOT_DUE,
            f"the agent says its drain deadline expired, but by the manager's clock it is"
            f" due in {due - now:.0f}s (the drone's clock may be wrong)",
        )
    if phase in (RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED):
        return (Removal.UNEXPECTED_WRITER, f"record {phase!s} written by the {writer}")
    if phase is None:
        return (Removal.RECORD_TAMPERED, f"the record is tampered: {record.tampered}")
    return None


def _when_lost(view: DroneView, lbs_running: bool | None, now: float) -> Verdict:
    """A lost agent: removable only if the batch system says the job is not running"""
    seen = view.last_seen
    silent = f"no sign of life for {now - seen:.0f}s" if seen is not None else "never seen"
    if lbs_running is False:
        return _yes(
            Removal.LOST_AND_NOT_RUNNING,
            f"agent lost ({silent}) and the batch system says the job is not running",
        )
    if lbs_running is None:
        return _no(
            Removal.LOST_LBS_UNKNOWN,
            f"agent lost ({silent}), but the batch system's view is unknown",
        )
    return _no(
        Removal.LOST_BUT_RUNNING,
        f"agent lost ({silent}), but the batch system says the job runs",
    )
