"""
Whom to release when COBalD shrinks a pool: the drone whose draining leaves the fewest cores idle

Its rule (:func:`release_choice`): drones whose agent never announced itself first (their
release is a handshake, nothing runs on them), then idle drones, then drones with payloads
by the core-seconds that would sit idle while they drain (each free slot waits for the
payload that ends last), then by the work left on them; among equals, the drone whose batch
job ends soonest first (it gives least anyway). A payload's work left is its requested
runtime minus its runtime so far where known, else the mean remaining runtime of the
payloads seen to end (:class:`Durations`) that ran at least as long, else as long again as
it has run so far; never more than the time until its drone's end, after which nothing
runs on it. Its runtime so far is counted by the agent's clock from its start to the
agent's newest event and by the bus's from then on (:func:`elapsed_since`), so a wrong
drone clock changes nothing. Every key is a number that sorts: whatever a drone sent, no key
is NaN, which would leave the order to chance.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import time
from typing import NamedTuple

from broker.manager.views import DroneView, elapsed_since, ends_in_s
from remote_agent.protocol.events import PayloadFinished

#: the registry's event kind of a payload's end
_FINISHED = "payload_finished"

#: payload ends kept for the estimate (the newest)
DURATIONS_KEPT = 500
#: fewer ends than this: the estimate is the runtime so far
DURATIONS_NEEDED = 5
#: the longest a payload is taken to have run, in seconds: longer than the whole range of
#: wire times (the years 1 to 9999), and short enough that every sum and product of the
#: release order stays finite
LONGEST_S = 1e12

#: a payload end: site, drone, the agent's incarnation and ``seq`` of its event
_End = tuple[str, str, str, int]


class Durations:
    """
    How long payloads ran, from their agents' ``payload_finished`` events; a registry watcher

    Written in the thread that applies the registry's messages; read from any
    thread (the sorted table is replaced whole).
    """

    def __init__(self, kept: int = DURATIONS_KEPT) -> None:
        self._seen: collections.deque[float] = collections.deque(maxlen=kept)
        #: the ends counted, newest last: the registry tells its watchers of a drone's view
        #: again when a note or its record changes while its newest event is still that end,
        #: and an event stored twice is one end
        self._ends: collections.deque[_End] = collections.deque(maxlen=kept)
        self._counted: set[_End] = set()
        #: the durations sorted, and the sums of each tail (``tails[i] = sum(sorted[i:])``)
        self._table: tuple[tuple[float, ...], tuple[float, ...]] = ((), (0.0,))

    def __len__(self) -> int:
        return len(self._table[0])

    def seen(self, view: DroneView) -> None:
        if view.kind != _FINISHED:
            return
        event = view.event
        if not isinstance(event, PayloadFinished) or event.duration_s is None:
            return
        end = (event.site, event.drone, event.incarnation, event.seq)
        if end in self._counted:
            return
        if len(self._ends) == self._ends.maxlen:
            self._counted.discard(self._ends[0])
        self._ends.append(end)
        self._counted.add(end)
        self.add(float(event.duration_s))

    def add(self, duration_s: float) -> None:
        """Count one payload's runtime, in seconds; one that is not a finite number is ignored"""
        if not math.isfinite(duration_s):
            return
        self._seen.append(min(max(0.0, duration_s), LONGEST_S))
        ordered = tuple(sorted(self._seen))
        tails = tuple(itertools.accumulate(reversed(ordered), initial=0.0))[::-1]
        self._table = (ordered, tails)

    def left(self, runtime_s: float) -> float | None:
        """Mean remaining seconds of a payload that ran ``runtime_s``; ``None``: too few seen"""
        ordered, tails = self._table
        if len(ordered) < DURATIONS_NEEDED:
            return None
        i = bisect.bisect_right(ordered, runtime_s)
        longer = len(ordered) - i
        if not longer:
            return 0.0  # it outlived every payload seen: expect its end any moment
        return tails[i] / longer - runtime_s


def work_left(
    runtime_s: float, durations: Durations | None, requested_s: float | None = None
) -> float:
    """The best estimate of a payload's remaining seconds (see the module's rule)"""
    if requested_s is not None:
        return max(0.0, requested_s - runtime_s)
    estimate = durations.left(runtime_s) if durations is not None else None
    return runtime_s if estimate is None else estimate


class Choice(NamedTuple):
    """A drone's place in the release order (ascending) and why"""

    rank: int  #: 0 never announced, 1 idle, 2 running payloads
    #: a drone never announced: seconds since TARDIS requested it, its place in the site's
    #: queue that a release gives up (the shortest wait goes first); else 0
    waited_s: float
    idle_core_s: float  #: core-seconds idle while it drains
    left_s: float  #: seconds until its last payload ends
    payloads: int
    #: seconds until the drone's batch job ends (infinity: its agent knows of no end)
    ends_in_s: float
    base: float  #: COBalD's own order: supply x utilisation

    @property
    def reason(self) -> str:
        if self.rank == 0:
            return f"its agent never announced itself (queued {self.waited_s:.0f}s)"
        end = f", its drone ends in {self.ends_in_s:.0f}s" if math.isfinite(self.ends_in_s) else ""
        if self.rank == 1:
            return f"no payload runs{end}"
        return (
            f"{self.payloads} payload(s), about {self.left_s:.0f}s left, "
            f"{self.idle_core_s:.0f} core-s idle while draining{end}"
        )


def release_choice(
    view: DroneView | None,
    cores: float,
    base: float,
    durations: Durations | None = None,
    now: float | None = None,
    requested: float | None = None,
) -> Choice:
    """
    The release order of one drone by its agent's newest snapshot (``view``)

    :param requested: when TARDIS requested the drone (epoch seconds), if known
    """
    event = view.event if view is not None else None
    base = _sortable(base)
    at = time.time() if now is None else now
    if view is None or event is None or view.received_time is None:
        waited = max(0.0, at - requested) if requested is not None else 0.0
        return Choice(0, _sortable(waited), 0.0, 0.0, 0, math.inf, base)
    snapshot = event.snapshot
    payloads = snapshot.payloads
    received = view.received_time
    ends_in = ends_in_s(event, received, at)
    life = math.inf if ends_in is None else min(ends_in, LONGEST_S)
    if not payloads:
        return Choice(1, 0.0, 0.0, 0.0, 0, life, base)
    lefts = [
        work_left(
            elapsed_since(payload.started_at, event, received, at),
            durations,
            payload.requested_s,
        )
        for payload in payloads
    ]
    lefts = [min(left, LONGEST_S, life) for left in lefts]
    last = max(lefts)
    slots = max(snapshot.slots, len(payloads))
    idle = (slots * last - sum(lefts)) * (cores / slots)
    return Choice(2, 0.0, _sortable(idle), _sortable(last), len(payloads), life, base)


def _sortable(key: float) -> float:
    """``key``, or infinity (last in the order) for NaN, which compares false with everything"""
    return math.inf if math.isnan(key) else key
