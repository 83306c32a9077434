"""
:class:`RemoteFactoryPool`: a COBalD FactoryPool that releases drones without payloads first
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cobald.composite.factory import FactoryPool

from broker.tardis.bus import RemoteBus


class RemoteFactoryPool(FactoryPool):
    """
    A FactoryPool that releases drones without payloads before drones with payloads

    Release order (ascending :meth:`release_key`): drones whose agent never
    announced itself (nothing can run on them: the release handshake stops
    them cheaply), then drones whose agent reports no payload, then drones
    with payloads, fewest first; ties by COBalD's own ``supply x utilisation``.

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

    def release_key(self, child: Any) -> tuple[int, int, float]:
        base = float(child.supply * child.utilisation)
        try:
            drone = child.resource_attributes["drone_uuid"]
        except (AttributeError, KeyError, TypeError):
            return (1, 0, base)
        bus = self.bus
        view = bus.registry.view(self.site, drone) if bus is not None else None
        snapshot = view.snapshot if view is not None else None
        if snapshot is None:
            return (0, 0, base)
        payloads = len(snapshot.payloads)
        return (2 if payloads else 1, payloads, base)

    def _shrink(self, target: float) -> None:
        # cobald 0.14 FactoryPool._shrink, with our order instead of supply x utilisation
        hit_list = sorted(self._hatchery, key=self.release_key)
        excess_demand = sum(child.demand for child in hit_list) - target
        for child in hit_list:
            if excess_demand <= 0:
                break
            if child.demand <= excess_demand:
                excess_demand -= child.demand
                self._release_child(child)
        self._reap_children()
