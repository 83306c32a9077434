"""
:class:`RemoteFactoryPool`: a COBalD FactoryPool that releases the drones that cost least first
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cobald.composite.factory import FactoryPool

from broker.tardis.bus import RemoteBus
from broker.tardis.release import Choice, release_choice

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")


class RemoteFactoryPool(FactoryPool):
    """
    A FactoryPool whose release order is :func:`~broker.tardis.release.release_choice`

    Drones whose agent never announced itself, then idle drones, then drones
    with payloads by the core-seconds idle while they drain; ties by COBalD's
    own ``supply x utilisation``. Each release is logged with its reason, and
    the reason goes with the drone's drain (its agent's ``gate_closed`` event
    in the drone's timeline).

    :meth:`_shrink` runs in COBalD's trio thread: the key reads plain
    attributes and the registry's immutable views only.
    """

    def __init__(
        self,
        *children: Any,
        factory: Callable[[], Any],
        interval: float = 30,
        bus: RemoteBus | None = None,
        site: str = "",
    ) -> None:
        super().__init__(*children, factory=factory, interval=interval)
        self.bus = bus
        self.site = site

    def release_key(self, child: Any) -> Choice:
        base = float(child.supply * child.utilisation)
        bus = self.bus
        try:
            drone = child.resource_attributes["drone_uuid"]
        except (AttributeError, KeyError, TypeError):
            return Choice(1, 0.0, 0.0, 0, base)
        if bus is None:
            return Choice(1, 0.0, 0.0, 0, base)
        view = bus.registry.view(self.site, drone)
        cores = float(getattr(child, "maximum_demand", child.demand))
        return release_choice(view, cores, base, bus.durations)

    def _shrink(self, target: float) -> None:
        # cobald 0.14 FactoryPool._shrink, with our order instead of supply x utilisation
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

    def _note_release(self, child: Any, choice: Choice) -> None:
        if self.bus is None:
            return
        drone = str(child.resource_attributes["drone_uuid"])
        reason = f"chosen for release: {choice.reason}"
        self.bus.release_reasons[drone] = reason
        log.info("%s/%s %s", self.site, drone, reason, extra={"drone": drone})


def _first(item: tuple[Choice, Any]) -> Choice:
    return item[0]
