"""
A drone's budget: how much of the manager's work and TARDIS's one drone may cause per second

Its rule: a drone may have :attr:`Budget.burst` things done at once and :attr:`Budget.per_s`
a second after that (a token bucket, kept as the one time per drone that the generic cell
rate algorithm needs); beyond it the work is put off, never dropped. For events
(:class:`Accounts`) that means: the registry holds a drone's newest valid event beyond the
budget, one per drone, and applies it when the budget allows it (within one interval,
``1 / per_s``) unless a newer event comes first, which supersedes it (*coalesced*). So a
drone's state is its newest valid event, late by at most one interval, and what it costs the
manager beyond checking each message is bounded whatever it sends. Events are accounted by
the bus's time (when the stream stored them), so a rebuild finds the floods the live registry
found; a drone is *noisy* for :data:`NOISY_FOR_S` after its last event beyond the budget.

The defaults are more than the largest honest drone does (:data:`EVENT_BUDGET`,
:data:`STATE_RUN_BUDGET`; ``docs/architecture.md``, "A drone's budget").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, NamedTuple

from broker.manager.lifecycle import lines
from broker.manager.schedule import Schedule
from remote_agent.protocol.fields import MAX_PAYLOADS


@dataclass(frozen=True, slots=True)
class Budget:
    """
    ``burst`` at once, then ``per_s`` a second

    :param per_s: the sustained rate, per second (> 0)
    :param burst: how many fit at once (>= 1)
    :raises ValueError: for anything else
    """

    per_s: float
    burst: int

    def __post_init__(self) -> None:
        if not (self.per_s > 0 and math.isfinite(self.per_s)):
            raise ValueError(f"per_s must be a positive number, not {self.per_s!r}")
        if self.burst < 1:
            raise ValueError(f"burst must be at least 1, not {self.burst!r}")

    @property
    def interval_s(self) -> float:
        """Seconds between two at the sustained rate: the longest that anything waits"""
        return 1.0 / self.per_s

    def wait_s(self, due: float, now: float) -> float:
        """
        Seconds from ``now`` until one more fits, for an account whose time is ``due``

        ``due`` is the account's theoretical time: when its bucket would be full again
        (``-inf`` for a new one). ``0.0``: it fits now.
        """
        return max(0.0, due - (self.burst - 1) * self.interval_s - now)

    def spent(self, due: float, now: float) -> float:
        """The account's time after one more at ``now``, which fits (:meth:`wait_s` is 0)"""
        return max(due, now) + self.interval_s


#: events of one drone applied at once and per second: every one of the largest drone's
#: MAX_PAYLOADS slots starting a payload at once, and a quarter more for what its agent says
#: besides (its start, its gate, heartbeats); then ten a second, while the payloads of 256
#: slots that each run a minute start and end about nine times a second
EVENT_BUDGET: Final = Budget(per_s=10.0, burst=MAX_PAYLOADS + MAX_PAYLOADS // 4)
#: TARDIS state runs of one drone that its agent's facts cause (woken runs and the runs that
#: follow them), at once and per second. A run follows a change of the facts, so an honest
#: drone runs at most as often as its events are applied: the same budget as for events
STATE_RUN_BUDGET: Final = EVENT_BUDGET
#: seconds a drone counts as noisy after its last event or run beyond its budget
NOISY_FOR_S: Final = 60.0


class Beat(NamedTuple):
    """What the registry keeps of a drone's newest heartbeat, beside its newest event"""

    seq: int
    stream_seq: int
    received_time: float
    interval_s: float
    at: float  #: the agent's clock when it made the heartbeat, epoch seconds


def newest_beat(beat: Beat | None, other: Beat | None) -> Beat | None:
    """The newer (by stream sequence) of two heartbeats' facts"""
    if beat is None or (other is not None and other.stream_seq > beat.stream_seq):
        return other
    return beat


class Held(NamedTuple):
    """A valid event beyond its drone's budget, as it came off the stream, not applied yet"""

    data: bytes
    received_time: float
    stream_seq: int
    #: the newest heartbeat facts it or the events it superseded carried (:class:`Beat`)
    beat: Beat | None


class Accounts:
    """
    Every drone's account of applied events, and the events held (pure state, no I/O)

    The registry charges each event newer than its drone's state (:meth:`charge`), holds one
    beyond the budget (:meth:`hold`) and applies it when :meth:`due` offers it. An account
    is one time per drone (when its bucket is full again); it is dropped once that has
    passed, as others are charged, so memory follows the drones that spoke in the last
    moments, not the fleet. Noisy drones and held events are kept apart: usually there are
    none, and the usual event costs one lookup.

    :param budget: each drone's budget of applied events
    """

    def __init__(self, budget: Budget = EVENT_BUDGET) -> None:
        self.budget = budget
        self._interval = budget.interval_s
        self._tolerance = (budget.burst - 1) * budget.interval_s
        #: each drone's theoretical time (:meth:`Budget.wait_s`), bus time
        self._due: dict[tuple[str, str], float] = {}
        #: the bus time of each drone's newest event beyond the budget
        self._over: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], Held] = {}
        self._releases = Schedule()
        self._sweep_at = 1024
        #: events held and then superseded by a newer one of the same drone, never applied
        self.coalesced = 0
        #: events held beyond a budget so far (applied later, or coalesced)
        self.held = 0

    def __len__(self) -> int:
        return len(self._due)

    def charge(self, key: tuple[str, str], stored: float) -> bool:
        """
        Charge one event of ``key`` stored at ``stored`` (bus time, epoch seconds)

        :returns: whether it was within the budget; if not, the drone is noisy from then on
        """
        due = self._due.get(key)
        if due is None:
            if len(self._due) >= self._sweep_at:
                self._sweep(stored)
            due = -math.inf
        elif due - self._tolerance > stored:  # Budget.wait_s, inlined: this runs for every event
            over = self._over
            if stored > over.get(key, -math.inf):
                over[key] = stored
            return False
        self._due[key] = (due if due > stored else stored) + self._interval
        return True

    def admit(self, key: tuple[str, str], stored: float) -> bool:
        """
        Charge one event of ``key`` if nothing is held for it (:meth:`charge`)

        :returns: whether it is to be applied now: nothing held, within the budget. If not,
            the caller looks closer (:meth:`holding`); nothing was charged if something is held
        """
        held = self._held
        if held and key in held:
            return False
        return self.charge(key, stored)

    def holding(self, key: tuple[str, str]) -> Held | None:
        """The event held for ``key``, if any"""
        held = self._held
        return held.get(key) if held else None

    def hold(self, key: tuple[str, str], held: Held, now: float) -> Held | None:
        """
        Hold ``held`` (newer than anything known of ``key``, charged beyond the budget)
        until the budget allows it

        :param now: the caller's clock (the one it passes to :meth:`due`)
        :returns: the event it supersedes, if one was held (counted as coalesced)
        """
        superseded = self._held.get(key)
        self._held[key] = held
        self.held += 1
        if superseded is not None:
            self.coalesced += 1
        else:
            wait = self.budget.wait_s(self._due.get(key, -math.inf), held.received_time)
            self._releases.add(key, now + wait)
        return superseded

    def beat(self, key: tuple[str, str], beat: Beat) -> None:
        """A heartbeat older than the event ``key`` holds: its facts go with that event"""
        held = self._held.get(key)
        if held is not None:
            self._held[key] = held._replace(beat=newest_beat(held.beat, beat))

    def take(self, key: tuple[str, str]) -> Held | None:
        """
        Drop what ``key`` holds, superseded by a newer event applied at once (coalesced)

        :returns: the event dropped, for the heartbeat facts it carries
        """
        superseded = self._held.pop(key, None)
        if superseded is not None:
            self.coalesced += 1
            self._releases.discard(key)
        return superseded

    def due(self, now: float) -> Iterator[tuple[tuple[str, str], Held]]:
        """
        The events whose budget allows them at ``now``, each charged and no longer held

        One at a time: those not taken yet stay held.

        :param now: the caller's clock, as given to :meth:`hold`
        """
        while (key := self._releases.pop_due(now)) is not None:
            held = self._held.pop(key, None)
            if held is None:
                continue
            # its turn is the first the budget gave it: charged at that time
            self._due[key] = self._due.get(key, held.received_time) + self._interval
            yield key, held

    @property
    def next_release(self) -> float | None:
        """When :meth:`due` has the next event to offer, on the caller's clock"""
        return self._releases.next_at()

    def noisy(self, now: float) -> dict[tuple[str, str], float]:
        """
        The drones with an event beyond the budget in the :data:`NOISY_FOR_S` before ``now``

        :param now: epoch seconds
        :returns: the bus time of each one's newest event beyond it, by ``(site, drone)``
        """
        since = now - NOISY_FOR_S
        return {key: over for key, over in list(self._over.items()) if over > since}

    def dropped(self, key: tuple[str, str]) -> None:
        """``key`` was retired: forget its account (it holds nothing: see :meth:`holding`)"""
        if key not in self._held:
            self._due.pop(key, None)
            self._over.pop(key, None)

    def _sweep(self, stored: float) -> None:
        """Drop the accounts full again by ``stored`` and the marks older than a noisy spell"""
        held = self._held
        self._due = {key: due for key, due in self._due.items() if due > stored or key in held}
        since = stored - NOISY_FOR_S
        self._over = {key: over for key, over in self._over.items() if over > since}
        self._sweep_at = max(1024, 2 * len(self._due))


def over_budget(site: str, drone: str, budget: Budget, what: str) -> None:
    """The operator's line for a drone over ``budget`` (at most one a minute per drone)"""
    lines.log(
        logging.WARNING,
        f"noisy {what} {site}/{drone}",
        "drone %s/%s is over its budget of %s (%d at once, %g a second): %s",
        site,
        drone,
        what,
        budget.burst,
        budget.per_s,
        "only its newest event is applied, when the budget allows"
        if what == "events"
        else "a woken state run waits until the budget allows it",
        extra={"site": site, "drone": drone},
    )
