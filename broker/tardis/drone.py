"""
:class:`EventDrone`: TARDIS's own drone, whose state machine also runs when it is woken

Its rule: one state run at a time; a wake during a run schedules at most one more, and a
woken run is followed at once by the next while it moves TARDIS to a state not yet seen since
the wake (up to :data:`CHAIN_RUNS` runs); with no wake, the drone waits its heartbeat as
TARDIS's does. Woken and following runs keep within the drone's budget
(:data:`~broker.manager.budget.STATE_RUN_BUDGET`): beyond it a run waits until the budget
allows it, and then sees every fact that came meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Final

from tardis.interfaces.siteadapter import ResourceStatus
from tardis.resources.drone import Drone
from tardis.resources.dronestates import DownState, RequestState

from broker.manager.budget import STATE_RUN_BUDGET, Budget
from broker.tardis.wake import Waker

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")

#: the most state runs one wake leads to: Booting -> Integrate -> Integrating ->
#: Available, and Available -> Disintegrate -> ShutDown -> ShuttingDown, with a
#: run to spare (a cycle such as Drain -> Draining -> Drain ends the chain anyway)
CHAIN_RUNS: Final = 5


class EventDrone(Drone):
    """
    A TARDIS ``Drone`` that :class:`~broker.tardis.wake.Waker` wakes on its agent's events

    Everything but the wait between state runs is TARDIS's: states, plugins
    (the SQLite registry among them), adapters, demand and supply.
    :attr:`state_runs`, :attr:`woken` and :attr:`delayed` count for tests and benchmarks.

    :param waker: wakes it, and is told of runs that waited for the budget
    :param budget: the state runs its agent's facts may cause
    """

    def __init__(
        self, *args: Any, waker: Waker, budget: Budget = STATE_RUN_BUDGET, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.waker = waker
        self.budget = budget
        self.state_runs = 0
        self.woken = 0
        #: woken or following runs that waited for the budget
        self.delayed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flag: asyncio.Event | None = None
        self._due = -math.inf  # the budget's account (the loop's clock)

    @property
    def demand(self) -> float:
        return float(self._demand)

    @demand.setter
    def demand(self, value: float) -> None:
        self._demand = value
        if not value:  # COBalD's FactoryPool releases by demand 0 (cobald/composite/factory.py)
            self.waker.released(self.resource_attributes.drone_uuid, self)

    def wake(self) -> None:
        """Run the state machine soon; safe from any thread, a no-op before :meth:`run`"""
        loop, flag = self._loop, self._flag
        if loop is None or flag is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            flag.set()
        else:
            loop.call_soon_threadsafe(flag.set)

    async def run(self) -> None:
        """``Drone.run`` (tardis/resources/drone.py:114-136), with a wait that a wake ends"""
        self._loop = asyncio.get_running_loop()
        self._flag = asyncio.Event()
        drone_uuid = self.resource_attributes.drone_uuid
        self.waker.enlist(drone_uuid, self)
        try:
            if self.state is None:  # as Drone.run: the first state change notifies the plugins
                self.resource_attributes.resource_status = ResourceStatus.Booting
                await self.set_state(RequestState())
            chain: list[type] = []  # the states a woken run went through
            while True:
                current = self.state
                self._flag.clear()  # what happened before this run, this run sees
                await current.run(self)
                self.state_runs += 1
                if isinstance(current, DownState):
                    log.debug("TARDIS drone %s is down", drone_uuid)
                    self._demand = 0
                    return
                if chain and self._goes_on(chain, current):
                    await self._paced()
                    continue
                chain = [] if not await self._rest() else [type(self.state)]
        finally:
            self.waker.discharge(drone_uuid, self)

    def _goes_on(self, chain: list[type], current: Any) -> bool:
        """Whether a woken run goes on at once: a new state, not seen in this chain"""
        new = type(self.state)
        if new is type(current) or new in chain or len(chain) >= CHAIN_RUNS:
            return False
        chain.append(new)
        return True

    async def _rest(self) -> bool:
        """Wait for a wake or the heartbeat; whether a wake ended it"""
        assert self._flag is not None
        try:  # asyncio.timeout, not wait_for: a wake racing a cancel must not eat the cancel
            async with asyncio.timeout(self.heartbeat_interval):
                await self._flag.wait()
        except TimeoutError:
            return False
        self.woken += 1
        await self._paced()
        return True

    async def _paced(self) -> None:
        """Wait until the budget allows one more run, and charge it"""
        assert self._loop is not None
        now = self._loop.time()
        wait = self.budget.wait_s(self._due, now)
        if wait > 0.0:
            self.delayed += 1
            self.waker.delayed(self.resource_attributes.drone_uuid, self.budget)
            await asyncio.sleep(wait)
            now += wait
        self._due = self.budget.spent(self._due, now)
