"""
:class:`RemoteFactoryPool`: a COBalD FactoryPool that shrinks only to the highest demand of a
window, and releases the drones that cost least first

Its rules: growing follows demand at once, but a site flagged as a black hole gets one probe
drone per backoff period at most (:meth:`~broker.manager.blackholes.BlackHoles.allowance`);
shrinking goes no lower than the highest demand in effect within the last ``window_s``
seconds (:class:`PeakWindow`, Kubernetes' scale-down stabilization window), so a dip
shorter than the window releases nothing; what is released is chosen by
:func:`~broker.tardis.release.release_choice`.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from cobald.composite.factory import FactoryPool

from broker.tardis.release import Choice, release_choice

if TYPE_CHECKING:  # the bus's configuration takes this module's default
    from broker.tardis.bus import RemoteBus

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")

#: default seconds of the scale-down stabilization window: the default of Kubernetes'
#: HPA (``behavior.scaleDown.stabilizationWindowSeconds``)
DEFAULT_SCALE_DOWN_WINDOW_S: Final = 300.0


class PeakWindow:
    """
    The highest value in effect within the last ``window_s`` seconds (``0``: the value now)

    Keeps each change of the value within the window, and the one in effect when it began:
    at most one entry per change. A pool's demand (COBalD's controllers set it every few
    seconds) and a drone's busy slots (:class:`~broker.tardis.batch.RemoteBatchSystemAdapter`)
    are held by it.

    :param clock: monotonic seconds (tests pass their own)
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        #: ``(when, demand)`` of each change, oldest first
        self._changes: collections.deque[tuple[float, float]] = collections.deque()

    def seen(self, value: float) -> None:
        """``value`` is in effect from now"""
        now = self._clock()
        if not self._changes or self._changes[-1][1] != value:
            self._changes.append((now, value))
        self._forget(now)

    def highest(self, value: float) -> float:
        """The highest of ``value`` (the value now) and every value in effect in the window"""
        if self.window_s <= 0:
            return value
        self._forget(self._clock())
        return max([value, *(held for _, held in self._changes)])

    def _forget(self, now: float) -> None:
        changes = self._changes
        # a value set before the window counts while it was in effect when the window began
        while len(changes) > 1 and changes[1][0] <= now - self.window_s:
            changes.popleft()


class RemoteFactoryPool(FactoryPool):
    """
    A FactoryPool that shrinks only to the highest demand of the last ``window_s`` seconds,
    and whose release order is :func:`~broker.tardis.release.release_choice`

    Drones whose agent never announced itself, then idle drones, then drones
    with payloads by the core-seconds idle while they drain; ties by COBalD's
    own ``supply x utilisation``. Each release is logged with its reason, and
    the reason goes with the drone's drain (its agent's ``gate_closed`` event
    in the drone's timeline).

    :meth:`_shrink` runs in COBalD's trio thread: the key reads plain
    attributes and the registry's immutable views only.

    :param window_s: the scale-down stabilization window (:class:`PeakWindow`);
        ``0``: shrink to the demand now, as COBalD's own pool does
    """

    def __init__(
        self,
        *children: Any,
        factory: Callable[[], Any],
        interval: float = 30,
        bus: RemoteBus | None = None,
        site: str = "",
        window_s: float = 0.0,
    ) -> None:
        self.window = PeakWindow(window_s)
        super().__init__(*children, factory=factory, interval=interval)
        self.window.seen(self._demand)
        self.bus = bus
        self.site = site

    @property
    def demand(self) -> float:
        return float(self._demand)

    @demand.setter
    def demand(self, value: float) -> None:
        # as FactoryPool's: acknowledge now, act at the next adjustment
        self._demand = value
        self.window.seen(value)

    def release_key(self, child: Any) -> Choice:
        base = float(child.supply * child.utilisation)
        bus = self.bus
        try:
            drone = child.resource_attributes["drone_uuid"]
        except (AttributeError, KeyError, TypeError):
            return Choice(1, 0.0, 0.0, 0.0, 0, base)
        if bus is None:
            return Choice(1, 0.0, 0.0, 0.0, 0, base)
        view = bus.registry.view(self.site, drone)
        cores = float(getattr(child, "maximum_demand", child.demand))
        return release_choice(view, cores, base, bus.durations, requested=_requested(child))

    def _shrink(self, target: float) -> None:
        # cobald 0.14 FactoryPool._shrink (cobald/composite/factory.py), to the window's
        # highest demand, with our order instead of supply x utilisation
        target = self.window.highest(target)
        keyed = sorted(((self.release_key(child), child) for child in self._hatchery), key=_first)
        excess_demand = sum(child.demand for _, child in keyed) - target
        for choice, child in keyed:
            if excess_demand <= 0:
                break
            if child.demand <= excess_demand:
                excess_demand -= child.demand
                self._note_release(child, choice)
                self._release_child(child)
        self._reap_children()

    def _grow(self, target: float) -> None:
        # cobald 0.14 FactoryPool._grow (cobald/composite/factory.py), asking a flagged
        # black-hole site for one probe drone per backoff period at most
        missing = target - sum(child.demand for child in self.children)
        allowed = (
            self.bus.black_holes.allowance(self.site, time.monotonic())
            if self.bus is not None and missing > 0
            else None
        )
        if allowed is None:
            super()._grow(target)
            return
        if allowed:
            self._hatchery.add(self.factory())
            log.info("%s: a black hole, asked for one probe drone", self.site)
        self._reap_children()

    def _note_release(self, child: Any, choice: Choice) -> None:
        if self.bus is None:
            return
        drone = str(child.resource_attributes["drone_uuid"])
        reason = f"chosen for release: {choice.reason}"
        self.bus.release_reasons[drone] = reason
        log.info("%s/%s %s", self.site, drone, reason, extra={"drone": drone})


def _requested(child: Any) -> float | None:
    """When TARDIS requested the drone: its ``created`` (tardis/resources/drone.py), epoch s"""
    created = child.resource_attributes.get("created")
    return created.timestamp() if isinstance(created, dt.datetime) else None


def _first(item: tuple[Choice, Any]) -> Choice:
    return item[0]
