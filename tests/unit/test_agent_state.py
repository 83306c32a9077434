"""The drone lifecycle's transition table"""

from __future__ import annotations

import itertools

import pytest

from remote_agent.agent.state import CLOSED_STATES, TRANSITIONS, Lifecycle, allowed
from remote_agent.errors import IllegalTransition
from remote_agent.protocol.events import DroneState

S = DroneState


def test_every_state_has_a_row() -> None:
    assert set(TRANSITIONS) == set(DroneState)


@pytest.mark.parametrize(("current", "wanted"), list(itertools.product(S, S)))
def test_moves_follow_the_table(current: DroneState, wanted: DroneState) -> None:
    lifecycle = Lifecycle(state=current)
    since = lifecycle.since
    if wanted is current:
        assert lifecycle.move(wanted) is False
        assert lifecycle.since == since
    elif allowed(current, wanted):
        assert lifecycle.move(wanted) is True
        assert lifecycle.state is wanted
    else:
        with pytest.raises(IllegalTransition, match=f"{current} -> {wanted}"):
            lifecycle.move(wanted)
        assert lifecycle.state is current


def test_the_happy_path_and_a_drain() -> None:
    lifecycle = Lifecycle()
    for state in (S.WORKER_UP, S.STARTD_READY, S.IDLE, S.BUSY, S.IDLE, S.BUSY):
        lifecycle.move(state)
    for state in (S.DRAINING, S.DRAINED, S.EXITING):
        lifecycle.move(state)
    assert lifecycle.state is S.EXITING


def test_every_state_can_exit_and_exiting_is_final() -> None:
    assert all(allowed(state, S.EXITING) for state in S if state is not S.EXITING)
    assert TRANSITIONS[S.EXITING] == frozenset()


def test_a_closed_gate_never_reopens() -> None:
    # from a state in which the gate is shut for good, no path leads to idle or busy
    for state in CLOSED_STATES:
        reachable, todo = set(), [state]
        while todo:
            for following in TRANSITIONS[todo.pop()]:
                if following not in reachable:
                    reachable.add(following)
                    todo.append(following)
        assert not reachable & {S.IDLE, S.BUSY, S.STARTD_READY, S.WORKER_UP}, state


def test_a_busy_drone_is_never_drained_without_draining() -> None:
    assert not allowed(S.BUSY, S.DRAINED)
    assert not allowed(S.IDLE, S.RELEASED)  # released is only for a drone that never came up
