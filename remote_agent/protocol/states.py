"""
The closed vocabularies the wire carries: drone states, payload ends, outcomes, record phases

Each value is a string on the wire; a value once written is never renamed or reused for
another meaning (``docs/protocol.md``, "Versioning rules"). The messages that carry them
are in :mod:`remote_agent.protocol.events`, which exports them too.
"""

from __future__ import annotations

import enum
from typing import Final


class DroneState(enum.StrEnum):
    """Lifecycle states of a drone as its agent sees them"""

    STARTING = "starting"  #: agent up, worker not yet started
    WORKER_UP = "worker_up"  #: worker process (condor_master) running
    STARTD_READY = "startd_ready"  #: the startd answers; no payload seen yet
    IDLE = "idle"  #: ready, gate open, no payload
    BUSY = "busy"  #: ready, at least one payload running
    DRAINING = "draining"  #: gate closed, payloads still running
    DRAINED = "drained"  #: gate closed, no payload; the drone is ending its job
    RELEASED = "released"  #: the manager released the drone before it announced itself
    EXITING = "exiting"  #: the agent is stopping


#: the states of a drone that cannot take work yet: its gate has not opened since its agent
#: started (the gate opens with the handshake claim, which waits for the startd to be ready,
#: and the drone is idle or busy from then on); no state leads back to them
STARTING_STATES: Final = frozenset(
    {DroneState.STARTING, DroneState.WORKER_UP, DroneState.STARTD_READY}
)


class PayloadEnd(enum.StrEnum):
    """How a payload ended, as HTCondor's JOB_EXIT hook reports it"""

    EXIT = "exit"
    REMOVE = "remove"
    HOLD = "hold"
    EVICT = "evict"
    UNKNOWN = "unknown"  #: vanished from ``condor_who`` without a JOB_EXIT hook


class Outcome(enum.StrEnum):
    """What the agent actually did in answer to a command"""

    DRAIN_ACCEPTED = "drain_accepted"  #: gate closed now; payloads may still run
    ALREADY_DRAINING = "already_draining"  #: an earlier drain is in effect
    DRAINED = "drained"  #: nothing runs any more; the drone is ending its job
    RELEASED = "released"  #: release-if-idle: the drone was idle and is ending
    BUSY = "busy"  #: release-if-idle refused: payloads are running
    STATUS = "status"  #: a status query; see the snapshot
    REFUSED = "refused"  #: the command cannot apply (see ``detail``)


class RecordPhase(enum.StrEnum):
    """Phases of a drone's handshake record in the KV bucket"""

    UP = "up"  #: the agent claimed the drone; its gate may open
    RELEASED = "released"  #: the manager won: no payload may ever start
    DRAINING = "draining"  #: drain intent with a deadline
    DRAINED = "drained"  #: the agent confirmed that nothing runs and the gate is shut
    DEADLINE_EXPIRED = "deadline_expired"  #: the agent's drain deadline passed
