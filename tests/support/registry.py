"""A registry fed by hand: events and records as the manager's consumer and watch apply them"""

from __future__ import annotations

import datetime as dt

from broker.manager.registry import Applied, Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace

NS = Namespace()
SITE = "site1"
#: the manager's proof key in these tests
PROOF_KEY = b"k" * 32


def event_subject(event: ev.Event) -> str:
    """The subject ``event`` is stored on"""
    return NS.event(event.site, event.drone, ev.kind_of(type(event)))


def apply_event(
    registry: Registry, event: ev.Event, at: float, stream_seq: int | None = None
) -> Applied:
    """``event`` as the consumer hands it to the registry, stored at ``at``"""
    return registry.apply_message(ev.encode(event), event_subject(event), at, stream_seq)


def make_record(
    phase: ev.RecordPhase, writer: str = "agent", drone: str = "site1-0000000001"
) -> ev.DroneRecord:
    """A handshake record of ``drone`` in ``phase``, written by ``writer``"""
    return ev.DroneRecord(
        site=SITE,
        drone=drone,
        phase=phase,
        writer=writer,  # type: ignore[arg-type]
        at=dt.datetime(2026, 3, 18, tzinfo=dt.UTC),
    )


def jobs_gone(registry: Registry, site: str, drones: int = 3, at: float = 1000.0) -> None:
    """
    ``drones`` drones of ``site`` whose jobs ended before their agents spoke: TARDIS's notes
    that it gave them up, nobody having released them (black holes, to the detector)
    """
    for i in range(drones):
        drone = f"{site}-{i:010x}"
        note = ev.TardisState(site=site, drone=drone, state="DownState", at=ev.utcnow())
        subject = registry.namespace.manager_note(site, drone, "tardis_state")
        registry.apply_note_message(ev.encode(note), subject, at + i)
    registry.mark_ended(at + drones)
