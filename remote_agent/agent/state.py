"""
The drone's lifecycle as the agent sees it: an explicit transition table

Like TARDIS's drone states, every state names the states it may lead to, and
nothing else is allowed: a move that is not in :data:`TRANSITIONS` raises
:class:`~remote_agent.errors.IllegalTransition`, because it means the agent's
own bookkeeping is wrong. Staying in a state is not a transition (another
payload starting on a busy drone changes the snapshot, not the state).

::

    starting --> worker_up --> startd_ready --> idle <--> busy
        |            |  \\___________________/    |        |
        |            |     (gate opens after    |        |
        |            |      the handshake claim) v        v
        |            +-----------------------> draining --> drained
        +-------> released  (the manager won the release race)
    any state but exiting --> exiting
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Final

from remote_agent.errors import IllegalTransition
from remote_agent.protocol.events import DroneState, utcnow

S = DroneState

#: every state and the states it may move to
TRANSITIONS: Final[Mapping[DroneState, frozenset[DroneState]]] = {
    # the worker failed to start, or the manager had released the drone already
    S.STARTING: frozenset({S.WORKER_UP, S.RELEASED, S.EXITING}),
    # startd_ready: the startd answers; idle/busy: --no-startd, the claim opened the gate
    # (busy: payloads found running by an agent that was restarted); draining/drained:
    # a drain (command or record) before the gate ever opened; released: the claim lost
    S.WORKER_UP: frozenset(
        {S.STARTD_READY, S.IDLE, S.BUSY, S.DRAINING, S.DRAINED, S.RELEASED, S.EXITING}
    ),
    S.STARTD_READY: frozenset({S.IDLE, S.BUSY, S.DRAINING, S.DRAINED, S.RELEASED, S.EXITING}),
    # drained straight from idle: release-if-idle
    S.IDLE: frozenset({S.BUSY, S.DRAINING, S.DRAINED, S.EXITING}),
    # a busy drone never becomes drained without draining first
    S.BUSY: frozenset({S.IDLE, S.DRAINING, S.EXITING}),
    S.DRAINING: frozenset({S.DRAINED, S.EXITING}),
    S.DRAINED: frozenset({S.EXITING}),
    S.RELEASED: frozenset({S.EXITING}),
    S.EXITING: frozenset(),
}

#: states in which the gate is shut for good
CLOSED_STATES: Final = frozenset({S.DRAINING, S.DRAINED, S.RELEASED, S.EXITING})


def allowed(current: DroneState, wanted: DroneState) -> bool:
    """Whether the table allows ``current -> wanted``"""
    return wanted in TRANSITIONS[current]


class Lifecycle:
    """The current state and since when it holds; moves only along :data:`TRANSITIONS`"""

    def __init__(self, at: dt.datetime | None = None, state: DroneState = S.STARTING) -> None:
        self.state = state
        self.since = at or utcnow()

    def move(self, wanted: DroneState, at: dt.datetime | None = None) -> bool:
        """
        Enter ``wanted``

        :returns: ``False`` if the drone is in ``wanted`` already (nothing changes)
        :raises IllegalTransition: if the table does not allow the move
        """
        if wanted is self.state:
            return False
        if not allowed(self.state, wanted):
            raise IllegalTransition(self.state, wanted)
        self.state = wanted
        self.since = at or utcnow()
        return True

    def __repr__(self) -> str:
        return f"Lifecycle({self.state}, since={self.since.isoformat()})"
