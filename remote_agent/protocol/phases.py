"""
The phases of a drone's handshake record and the transitions cooperating clients keep to

A drone can still write any value to its own key; :func:`allowed` is what
:class:`~remote_agent.protocol.handshake.RecordStore` refuses to write::

    (absent) --agent claim--> UP --drain--> DRAINING --agent--> DRAINED
    (absent) --manager release--> RELEASED          \\--agent--> DEADLINE_EXPIRED
    UP --agent claim (new incarnation)--> UP
    UP --agent, idle release--> DRAINED
"""

from __future__ import annotations

from typing import Final

from remote_agent.protocol.events import RecordPhase

#: phases in which no payload may start and nothing will ever open the gate again
CLOSED_PHASES: Final = frozenset(
    {RecordPhase.RELEASED, RecordPhase.DRAINING, RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED}
)

_TRANSITIONS = {
    RecordPhase.UP: {
        RecordPhase.UP,
        RecordPhase.DRAINING,
        RecordPhase.DRAINED,
        RecordPhase.DEADLINE_EXPIRED,
    },
    RecordPhase.DRAINING: {RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED},
    RecordPhase.DEADLINE_EXPIRED: {RecordPhase.DRAINED},
    RecordPhase.RELEASED: set(),
    RecordPhase.DRAINED: set(),
}

#: phases nothing follows: a record in one of them stays as it is
FINAL_PHASES: Final = frozenset(phase for phase, following in _TRANSITIONS.items() if not following)


def allowed(old: RecordPhase, new: RecordPhase) -> bool:
    """Whether a cooperating client may write ``new`` over a record in ``old``"""
    return new in _TRANSITIONS[old]
