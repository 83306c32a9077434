"""
:class:`RemoteFactoryPool`: a COBalD FactoryPool that shrinks only to the highest demand of a
window, and releases the drones that cost least first

Its rules: growing follows demand at once, but a site flagged as a black hole gets one probe
drone per backoff period at most (:meth:`~broker.manager.blackholes.BlackHoles.allowance`);
shrinking goes no lower than the highest demand in effect within the last ``window_s``
seconds (:class:`PeakWindow`, Kubernetes' scale-down stabilization window), so a dip
shorter than the window releases nothing; what is released is chosen by
:func:`~broker.tardis.release.release_choice`.

Make before break: a drone whose batch job ends before a new drone would start
(:class:`StartLatency`) and run a payload is *ending*. It no longer counts toward the pool's
supply, demand, utilisation and allocation, so the pool grows its replacement while it still
runs; once the drones that count supply the demand, the ending drone is released (it
drains, and its payloads, which the gate let in only if they end in time, finish).
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import math
import time
import weakref
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
#: default seconds a new drone takes from TARDIS's request until TARDIS counts it as supply,
#: until the pool has seen :data:`STARTS_NEEDED` of its own drones start
DEFAULT_DRONE_START_S: Final = 600.0
#: the newest starts of the pool's drones the estimate reads
STARTS_KEPT: Final = 20
#: starts seen before the estimate replaces the default
STARTS_NEEDED: Final = 3
#: the share of the starts seen that took no longer than the estimate
START_QUANTILE: Final = 0.9


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


class StartLatency:
    """
    How long a new drone of the pool takes to start: from TARDIS's request (its ``created``)
    until the pool first sees it as supply (TARDIS's AvailableState), measured at the pool's
    adjustments, so up to one ``interval`` late

    The estimate is the 90th percentile of the newest :data:`STARTS_KEPT` starts once
    :data:`STARTS_NEEDED` were seen, else ``default_s``.
    """

    def __init__(self, default_s: float = DEFAULT_DRONE_START_S, kept: int = STARTS_KEPT) -> None:
        self.default_s = default_s
        self._seen: collections.deque[float] = collections.deque(maxlen=kept)

    def seen(self, seconds: float) -> None:
        """One drone took ``seconds`` to start; a value that is not a finite span is ignored"""
        if math.isfinite(seconds) and seconds >= 0:
            self._seen.append(seconds)

    @property
    def estimate_s(self) -> float:
        if len(self._seen) < STARTS_NEEDED:
            return self.default_s
        ordered = sorted(self._seen)
        return ordered[min(len(ordered) - 1, math.ceil(START_QUANTILE * len(ordered)) - 1)]


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
    :param start_s: seconds a new drone is taken to need to start until the pool has
        measured its own (:class:`StartLatency`)
    """

    def __init__(
        self,
        *children: Any,
        factory: Callable[[], Any],
        interval: float = 30,
        bus: RemoteBus | None = None,
        site: str = "",
        window_s: float = 0.0,
        start_s: float = DEFAULT_DRONE_START_S,
    ) -> None:
        self.window = PeakWindow(window_s)
        super().__init__(*children, factory=factory, interval=interval)
        self.window.seen(self._demand)
        self.bus = bus
        self.site = site
        self.start = StartLatency(start_s)
        #: children whose start was measured, or that are not the pool's to measure (restored)
        self._started: weakref.WeakSet[Any] = weakref.WeakSet(children)
        #: drone uuids of the ending children, as of the last adjustment; replaced whole
        self._ending: frozenset[str] = frozenset()

    @property
    def demand(self) -> float:
        return float(self._demand)

    @demand.setter
    def demand(self, value: float) -> None:
        # as FactoryPool's: acknowledge now, act at the next adjustment
        self._demand = value
        self.window.seen(value)

    # cobald 0.14 FactoryPool's supply, utilisation and allocation, without ending children

    @property
    def supply(self) -> float:
        return float(sum(child.supply for child in self.children if not self._is_ending(child)))

    @property
    def utilisation(self) -> float:
        return _mean([c.utilisation for c in self.children if self._counts_as_supply(c)])

    @property
    def allocation(self) -> float:
        return _mean([c.allocation for c in self.children if self._counts_as_supply(c)])

    def _counts_as_supply(self, child: Any) -> bool:
        return bool(child.supply > 0) and not self._is_ending(child)

    def _is_ending(self, child: Any) -> bool:
        return bool(self._ending) and _drone_of(child) in self._ending

    def ends_in_s(self, child: Any) -> float | None:
        """Seconds until ``child``'s batch job ends, by its agent; ``None``: not known"""
        drone = _drone_of(child)
        if self.bus is None or drone is None:
            return None
        view = self.bus.registry.view(self.site, drone)
        return view.ends_in_s(time.time()) if view is not None else None

    @property
    def lead_s(self) -> float:
        """
        How long before its batch job's end a drone is replaced: the time a new drone takes to
        start, and a payload's mean runtime (the gate lets in only payloads that end before
        the drone does, so its slots empty about one payload before its end)
        """
        mean = self.bus.durations.left(0.0) if self.bus is not None else None
        return self.start.estimate_s + (mean or 0.0)

    def _observe(self) -> None:
        """
        Measure the starts of the children that became supply, and find the ending ones:
        supply whose batch job ends within :attr:`lead_s`
        """
        now = time.time()
        for child in self._hatchery:
            if child.supply > 0 and child not in self._started:
                self._started.add(child)
                requested = _requested(child)
                if requested is not None:
                    self.start.seen(now - requested)
        lead_s = self.lead_s
        ending = set()
        for child in self._hatchery:
            if child.supply <= 0:
                continue
            left = self.ends_in_s(child)
            if left is not None and left <= lead_s:
                ending.add(str(_drone_of(child)))
        self._ending = frozenset(ending)

    def _retire_ending(self, target: float) -> None:
        """Release the ending children once the children that count supply ``target``"""
        ending = [child for child in self._hatchery if self._is_ending(child)]
        if not ending:
            return
        counted = sum(child.supply for child in self._hatchery if self._counts_as_supply(child))
        if counted < target:
            return  # the replacements are not up yet: the ending drones work on
        lead_s = self.lead_s
        for child in ending:
            left = self.ends_in_s(child)
            reason = (
                f"its drone ends in {left or 0.0:.0f}s, before a new drone would start and "
                f"run a payload ({lead_s:.0f}s), and the drones that replace it are up"
            )
            self._note_release(child, reason)
            self._release_child(child)

    def release_key(self, child: Any) -> Choice:
        base = float(child.supply * child.utilisation)
        bus = self.bus
        drone = _drone_of(child)
        if drone is None or bus is None:
            return Choice(1, 0.0, 0.0, 0.0, 0, math.inf, base)
        view = bus.registry.view(self.site, drone)
        cores = float(getattr(child, "maximum_demand", child.demand))
        return release_choice(view, cores, base, bus.durations, requested=_requested(child))

    def _shrink(self, target: float) -> None:
        # cobald 0.14 FactoryPool._shrink (cobald/composite/factory.py), to the window's
        # highest demand, with our order instead of supply x utilisation; ending children
        # do not count
        self._observe()
        target = self.window.highest(target)
        keyed = sorted(
            (
                (self.release_key(child), child)
                for child in self._hatchery
                if not self._is_ending(child)
            ),
            key=_first,
        )
        excess_demand = sum(child.demand for _, child in keyed) - target
        for choice, child in keyed:
            if excess_demand <= 0:
                break
            if child.demand <= excess_demand:
                excess_demand -= child.demand
                self._note_release(child, choice.reason)
                self._release_child(child)
        self._retire_ending(target)
        self._reap_children()

    def _grow(self, target: float) -> None:
        # cobald 0.14 FactoryPool._grow (cobald/composite/factory.py) without ending
        # children, asking a flagged black-hole site for one probe drone per backoff
        # period at most
        self._observe()
        missing = target - sum(
            child.demand for child in self.children if not self._is_ending(child)
        )
        allowed = (
            self.bus.black_holes.allowance(self.site, time.monotonic())
            if self.bus is not None and missing > 0
            else None
        )
        if allowed is None:
            while missing > 0:
                child = self.factory()
                self._hatchery.add(child)
                if child.demand <= 0:
                    raise ValueError("factory must produce children with initial demand")
                missing -= child.demand
        elif allowed:
            self._hatchery.add(self.factory())
            log.info("%s: a black hole, asked for one probe drone", self.site)
        self._retire_ending(target)
        self._reap_children()

    def _note_release(self, child: Any, why: str) -> None:
        if self.bus is None:
            return
        drone = str(child.resource_attributes["drone_uuid"])
        reason = f"chosen for release: {why}"
        self.bus.release_reasons[drone] = reason
        log.info("%s/%s %s", self.site, drone, reason, extra={"drone": drone})


def _drone_of(child: Any) -> str | None:
    """A child's drone uuid, if it is a TARDIS drone"""
    try:
        return str(child.resource_attributes["drone_uuid"])
    except (AttributeError, KeyError, TypeError):
        return None


def _mean(values: list[float]) -> float:
    """COBalD's mean of its children's ratios: ``1.0`` without any"""
    return sum(values) / len(values) if values else 1.0


def _requested(child: Any) -> float | None:
    """When TARDIS requested the drone: its ``created`` (tardis/resources/drone.py), epoch s"""
    created = child.resource_attributes.get("created")
    return created.timestamp() if isinstance(created, dt.datetime) else None


def _first(item: tuple[Choice, Any]) -> Choice:
    return item[0]
