"""
:class:`Waker`: wakes the TARDIS drone a registry change is about, once per change of its facts

Its rule: a drone is woken only if its agent announced itself, and only when a fact TARDIS's
answers read changed (the agent's state, a lifecycle event, the record, lost or ended); a
heartbeat that changes nothing and TARDIS's own state notes wake nobody. It also keeps which
drones' runs waited for their budget (:mod:`broker.manager.budget`): noisy for a minute.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Protocol

from broker.manager.budget import NOISY_FOR_S, Budget, over_budget
from broker.manager.views import DroneView
from remote_agent.protocol.environment import site_of

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")

#: the registry's event kind of a heartbeat (carries a snapshot, no lifecycle step)
_HEARTBEAT = "heartbeat"

#: what a woken drone's answers depend on: agent state, lifecycle step, record, lost, ended
_Facts = tuple[object, int | None, int | None, bool, str]


class Wakeable(Protocol):
    """A drone that runs its state machine at once when woken"""

    def wake(self) -> None: ...


class Waker:
    """
    A registry watcher that wakes enlisted drones when their facts change

    Runs in the thread that applies the registry's messages (the asyncio loop
    inside COBalD); :meth:`Wakeable.wake` may be called from any thread.

    :param announced: whether a drone (by uuid) has an agent that announced itself
    :param clock: monotonic seconds, for :meth:`noisy`
    """

    def __init__(
        self, announced: Callable[[str], bool], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._announced = announced
        self._clock = clock
        self._drones: dict[str, Wakeable] = {}
        self._facts: dict[str, _Facts] = {}
        #: when each drone's state runs last waited for its budget (``clock``)
        self._noisy: dict[str, float] = {}
        self._prune_at = 64
        self.counts: collections.Counter[str] = collections.Counter()

    def enlist(self, drone_uuid: str, drone: Wakeable) -> None:
        """``drone`` runs its state machine: wake it on its facts' changes"""
        self._drones[drone_uuid] = drone

    def discharge(self, drone_uuid: str, drone: Wakeable) -> None:
        """``drone`` stopped running (TARDIS's DownState): forget it"""
        if self._drones.get(drone_uuid) is drone:
            del self._drones[drone_uuid]
            self._facts.pop(drone_uuid, None)

    def seen(self, view: DroneView) -> None:
        """The registry's watcher: wake the drone ``view`` is about if its facts changed"""
        drone = self._drones.get(view.drone)
        if drone is None or view.encoded is None:
            return  # not run by this TARDIS, or no agent announced itself: heartbeat only
        old = self._facts.get(view.drone)
        step = view.stream_seq
        if view.kind == _HEARTBEAT and old is not None:
            step = old[1]  # a heartbeat is no lifecycle step
        record = view.record.revision if view.record is not None else None
        facts: _Facts = (view.state, step, record, view.lost, view.ended)
        if facts == old:
            self.counts["wake_unchanged"] += 1
            return
        self._facts[view.drone] = facts
        self.counts["wake_event"] += 1
        self._wake(view.drone, drone)

    def released(self, drone_uuid: str, drone: Wakeable) -> None:
        """COBalD released ``drone`` (demand 0): wake it if its agent announced itself"""
        if self._drones.get(drone_uuid) is not drone or not self._announced(drone_uuid):
            return
        self.counts["wake_release"] += 1
        self._wake(drone_uuid, drone)

    def delayed(self, drone_uuid: str, budget: Budget) -> None:
        """A woken state run of ``drone_uuid`` waits for its ``budget``: count and tell"""
        self.counts["state_runs_delayed"] += 1
        now = self._clock()
        if drone_uuid not in self._noisy and len(self._noisy) >= self._prune_at:
            since = now - NOISY_FOR_S
            self._noisy = {uuid: at for uuid, at in self._noisy.items() if at > since}
            self._prune_at = max(64, 2 * len(self._noisy))
        self._noisy[drone_uuid] = now
        over_budget(site_of(drone_uuid) or "", drone_uuid, budget, "TARDIS state runs")

    def noisy(self) -> int:
        """Drones whose state runs waited for their budget within the last minute (any thread)"""
        since = self._clock() - NOISY_FOR_S
        return sum(at > since for at in list(self._noisy.values()))

    def _wake(self, drone_uuid: str, drone: Wakeable) -> None:
        try:
            drone.wake()
        except Exception:  # a watcher must not raise into the registry
            self.counts["wake_failed"] += 1
            log.exception("cannot wake TARDIS drone %s", drone_uuid)
