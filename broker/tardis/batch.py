"""
:class:`RemoteBatchSystemAdapter`: the overlay batch system's answers from the agents' reports

Nothing may escape these calls (no drone state catches them): each returns a safe value.
"""

from __future__ import annotations

import collections
import math
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus

from broker.manager.outcomes import DrainResult
from broker.manager.views import DroneView
from broker.tardis.pool import PeakWindow
from remote_agent.protocol.events import DroneState, RecordPhase

if TYPE_CHECKING:  # the bus's configuration takes this module's default
    from broker.tardis.bus import RemoteBus

#: default seconds a slot whose payload ended still counts as busy: HTCondor's
#: ``NEGOTIATOR_INTERVAL`` (60 s), the time the overlay pool takes to match a queued payload
#: to it; its claim stays ``Claimed`` between its jobs (claim reuse), as the overlay pool's own
#: view, which stock TARDIS reads, shows it
DEFAULT_UTILISATION_HOLD_S: Final = 60.0

#: the overlay batch system's view of a drone, from its agent's state: available once its
#: startd can take work (its gate opened: idle or busy), never ``NotAvailable`` after that
#: (docs/tardis.md, "When a drone is supply")
_MACHINE_STATUS: Final = {
    DroneState.STARTING: MachineStatus.NotAvailable,
    DroneState.WORKER_UP: MachineStatus.NotAvailable,
    DroneState.STARTD_READY: MachineStatus.NotAvailable,
    DroneState.IDLE: MachineStatus.Available,
    DroneState.BUSY: MachineStatus.Available,
    DroneState.DRAINING: MachineStatus.Draining,
    DroneState.DRAINED: MachineStatus.Drained,
    DroneState.RELEASED: MachineStatus.Drained,
    DroneState.EXITING: MachineStatus.Drained,
}

#: states in which a drone takes payloads: a freed slot's share is held
_BUSY_STATES: Final = frozenset({DroneState.IDLE, DroneState.BUSY})


class _Held(NamedTuple):
    """A drone's busy shares of the hold, and when its gate was first seen open (monotonic)"""

    window: PeakWindow
    opened: float


class RemoteBatchSystemAdapter(BatchSystemAdapter):
    """
    Wraps TARDIS's batch-system adapter instance (the overlay batch system)

    ``BatchSystemAgent`` forwards raw and no drone state catches anything from
    these calls, so nothing may escape: every call returns a safe value.
    """

    def __init__(self, inner: BatchSystemAdapter, bus: RemoteBus) -> None:
        self._inner = inner
        self._bus = bus
        self._last_status: dict[str, MachineStatus] = {}
        #: each drone's busy share, held for ``bus.utilisation_hold_s``, while its gate is open
        self._busy_held: dict[str, _Held] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        bus.count_sources["batch_system"] = self.counts

    @property
    def inner(self) -> BatchSystemAdapter:
        return self._inner

    @property
    def machine_meta_data_translation_mapping(self) -> Any:
        return self._inner.machine_meta_data_translation_mapping

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_inner", "_bus"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    async def _fallback(self, call: str, drone_uuid: str, default: Any) -> Any:
        self.counts[f"{call}_from_adapter"] += 1
        try:
            return await getattr(self._inner, call)(drone_uuid=drone_uuid)
        except Exception as err:
            self.counts[f"{call}_failed"] += 1
            self._bus.call_log.failed(
                f"batch system {call}", drone_uuid, err, f"answering {default!r}"
            )
            return default

    def _view(self, drone_uuid: str) -> DroneView | None:
        return self._bus.fresh(self._bus.site_of(drone_uuid), drone_uuid)

    async def integrate_machine(self, drone_uuid: str) -> None:
        await self._fallback("integrate_machine", drone_uuid, None)

    async def disintegrate_machine(self, drone_uuid: str) -> None:
        await self._fallback("disintegrate_machine", drone_uuid, None)

    async def drain_machine(self, drone_uuid: str) -> None:
        """The drone's self-drain; the wrapped adapter's drain when its agent is not heard"""
        try:
            handled = await self._self_drain(drone_uuid)
        except Exception as err:
            self.counts["drain_failed"] += 1
            self._bus.call_log.failed(
                "self-drain", drone_uuid, err, "the wrapped adapter drains it in the overlay pool"
            )
            handled = False
        if not handled:
            await self._fallback("drain_machine", drone_uuid, None)

    async def _self_drain(self, drone_uuid: str) -> bool:
        """
        Drain the drone through its record; release it if its agent has not claimed one

        Releasing a drone whose agent has not claimed is its drain: nothing can have
        started on it, and its claim finds the record released
        (:meth:`~broker.manager.control.Control.drain_or_release`).

        :returns: whether its agent is heard from and so needs no drain in the overlay pool
        """
        control = self._bus.control
        if control is None:
            return False
        site = self._bus.site_of(drone_uuid)
        why = self._bus.release_reasons.pop(drone_uuid, "") or "TARDIS drain"
        deadline = self._bus.drain_deadline()
        if self._bus.announced(site, drone_uuid) is None:
            # never announced: release it (or learn that its agent won, and drain);
            # its startd, if it runs without an agent, is drained in the OBS as well
            released = await control.release(site, drone_uuid, note=why, deadline=deadline)
            self.counts[f"drain_release_{released.outcome}"] += 1
            return False
        result = await control.drain_or_release(site, drone_uuid, deadline, why)
        if isinstance(result, DrainResult):
            self.counts[f"drain_{result.outcome}"] += 1
        else:  # announced, not claimed: released, or drained had the claim come first
            self.counts["drain_not_announced"] += 1
            self.counts[f"drain_release_{result.outcome}"] += 1
        # a lost agent may not act on the recorded intent soon: drain in the OBS too
        return self._bus.fresh(site, drone_uuid) is not None

    def _agent_status(self, view: DroneView) -> MachineStatus:
        """
        The status the agent's state says, but never ``NotAvailable`` after another answer

        TARDIS's AvailableState and DrainingState go to ShutDownState on ``NotAvailable``
        (dronestates.py:156, :209): a drone whose agent restarted (a new incarnation
        starts again) keeps the answer it had.
        """
        assert view.state is not None
        status = _MACHINE_STATUS[view.state]
        if status is MachineStatus.Available and view.phase is RecordPhase.DRAINING:
            # the drain is recorded (the manager merges the record as it writes it) and the
            # agent's events say so only a moment later: ``Available`` would send TARDIS's
            # DrainingState straight back to DrainState (dronestates.py:207), a flip pair
            status = MachineStatus.Draining
        last = self._last_status.get(view.drone)
        if status is MachineStatus.NotAvailable and last is not None:
            return last
        return status

    async def get_machine_status(self, drone_uuid: str) -> MachineStatus:
        view = self._view(drone_uuid)
        if view is not None and view.state is not None:
            self.counts["get_machine_status_from_agent"] += 1
            status = self._agent_status(view)
        else:
            default = self._last_status.get(drone_uuid, MachineStatus.NotAvailable)
            status = await self._fallback("get_machine_status", drone_uuid, default)
            if not isinstance(status, MachineStatus):
                status = default
        self._last_status[drone_uuid] = status
        return status

    def _busy_fraction(self, view: DroneView) -> float:
        snapshot = view.snapshot
        if snapshot is None or snapshot.slots <= 0:
            return 0.0
        return min(1.0, len(snapshot.payloads) / snapshot.slots)

    def _held(self, view: DroneView, call: str) -> float:
        """
        The drone's share of busy slots, the highest of the last ``bus.utilisation_hold_s``;
        its utilisation is whole for as long after its gate opened

        A slot whose payload ended, and a drone whose gate just opened, are work the overlay
        pool has not yet had a negotiation cycle to match a queued payload to; COBalD's
        ``LinearController`` lowers the demand for every step the utilisation is below its
        floor, so counting them idle at once gives up drones that payloads wait for. A new
        drone's allocation is its own (nothing allocated yet): it raises no demand either
        (docs/tardis.md, "When a drone is supply").
        """
        busy = self._busy_fraction(view)
        if view.state not in _BUSY_STATES:  # a drone that drains or ended takes no more work
            self._busy_held.pop(view.drone, None)
            return busy
        hold_s = self._bus.config.utilisation_hold_s
        held = self._busy_held.get(view.drone)
        if held is None:
            held = self._busy_held[view.drone] = _Held(PeakWindow(hold_s), time.monotonic())
        held.window.seen(busy)
        if call == "get_utilisation" and time.monotonic() - held.opened < hold_s:
            return 1.0
        return held.window.highest(busy)

    async def _busy(self, call: str, drone_uuid: str) -> float:
        """The agent's share of busy slots, else the wrapped adapter's answer to ``call``"""
        view = self._view(drone_uuid)
        if view is not None:
            self.counts[f"{call}_from_agent"] += 1
            return self._held(view, call)
        return _number(await self._fallback(call, drone_uuid, 0.0))

    async def get_allocation(self, drone_uuid: str) -> float:
        return await self._busy("get_allocation", drone_uuid)

    async def get_utilisation(self, drone_uuid: str) -> float:
        return await self._busy("get_utilisation", drone_uuid)


def _number(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0
