"""
The schedule test of the release handshake: generated schedules, checked as they run

Drives the real agent (``remote_agent.agent.Agent`` with its real gate socket)
and the real manager (``broker.manager.service.ManagerService`` and its ``Control``)
against a real nats-server through generated schedules of: agent start (its
claim), agent crash and restart, manager release, manager drain, TARDIS's drain (a
drain, or a release while the agent has not claimed), payload start
through the gate (the hook's own client code), payload end, manager restart,
broker restart, and lost command messages (the agent's connection cut while
commands are sent), plus deliberate races of claim against release, of claim
against TARDIS's drain and of a drain against a payload start.

After every step it checks:

* no payload is allowed after the manager won a release, and none after the
  agent accepted a drain (the test saw the acceptance before asking);
* a drone with a running payload is never reported removable before its drain
  deadline;

and at the end of each schedule, after healing the network and letting the
drone run to its end:

* every release ends with the drone gone and every drain with drained or
  deadline-expired; a drone neither released nor drained is drained last;
* no drone is stuck: the agent exits 0 and the manager then says removable;
* in the drone's own event stream no ``payload_started`` follows its
  ``drain_accepted`` or ``released``.

``COBALD_REMOTE_SCHEDULES`` sets how many schedules are explored (each
seeded by its number, so a failure names a reproducible schedule).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from support.schedules import LONG_DRAIN_S, SITE, Drone, Proxy, World, fresh_world

SCHEDULES = int(os.environ.get("COBALD_REMOTE_SCHEDULES", "60"))
FIRST = int(os.environ.get("COBALD_REMOTE_SCHEDULE_FIRST", "0"))  #: to replay one schedule
STEPS = 8
SHORT_DRAIN_S = 1.5

ACTIONS: dict[str, int] = {  # action: weight
    "agent_start": 4,
    "agent_restart": 2,
    "release": 3,
    "drain": 3,
    "drain_short": 1,
    "tardis_drain": 2,
    "payload_start": 5,
    "payload_end": 3,
    "manager_restart": 1,
    "broker_restart": 1,
    "cut_agent": 1,
    "heal_agent": 1,
    "race_claim_release": 2,
    "race_drain_payload": 2,
    "race_claim_tardis_drain": 2,
}


async def _step(world: World, drone: Drone, action: str) -> None:
    steps: dict[str, Callable[[], Awaitable[object]]] = {
        "agent_start": lambda: world.start_agent(drone),
        "agent_restart": lambda: _restart_agent(world, drone),
        "release": lambda: world.release(drone),
        "drain": lambda: world.drain(drone, LONG_DRAIN_S),
        "drain_short": lambda: world.drain(drone, SHORT_DRAIN_S),
        "tardis_drain": lambda: world.drain_or_release(drone),
        "payload_start": lambda: world.payload_start(drone),
        "payload_end": lambda: world.payload_end(drone),
        "manager_restart": lambda: _restart_manager(world),
        "broker_restart": lambda: world.server.restart(),
        "cut_agent": lambda: drone.proxy.cut(),
        "heal_agent": lambda: drone.proxy.restore_if_cut(),
        "race_claim_release": lambda: asyncio.gather(
            world.start_agent(drone), world.release(drone)
        ),
        "race_drain_payload": lambda: asyncio.gather(
            world.drain(drone, LONG_DRAIN_S), world.payload_start(drone)
        ),
        "race_claim_tardis_drain": lambda: asyncio.gather(
            world.start_agent(drone), world.drain_or_release(drone)
        ),
    }
    drone.log.append(action)
    await steps[action]()


async def _restart_agent(world: World, drone: Drone) -> None:
    await world.crash_agent(drone)
    await world.start_agent(drone)


async def _restart_manager(world: World) -> None:
    await world.stop_manager()
    await world.start_manager()


async def run_schedule(number: int, tmp_path: Path) -> int:
    """Run schedule ``number``; the number of steps it took"""
    rng = random.Random(number)
    schedule = rng.choices(list(ACTIONS), list(ACTIONS.values()), k=STEPS)
    async with fresh_world(tmp_path / f"s{number}") as world:
        proxy = Proxy(int(world.server.url.rpartition(":")[2]))
        await proxy.start()
        drone = Drone(f"{SITE}-schedule{number:05d}", proxy)
        try:
            for action in schedule:
                await _step(world, drone, action)
                world.check_removal(drone)
            await world.settle(drone)
        except BaseException as err:
            err.add_note(f"schedule {number}: {schedule}; log: {drone.log}")
            raise
        finally:
            await world.crash_agent(drone)
            if drone.gate is not None:  # an agent that ended by itself leaves its gate open
                await drone.gate.close()
            await proxy.close()
    print(f"schedule {number}: {' '.join(schedule)}: {drone.log[-1]}", flush=True)
    return len(schedule)


# A broker restart while the agent's proxy accepts a connection ends that connection before
# the server's INFO, and nats-py then never closes its socket (see support.servers.TcpProxy.cut).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(max(600, SCHEDULES * 60))
async def test_no_schedule_breaks_the_handshake(tmp_path: Path) -> None:
    explored = steps = 0
    for number in range(FIRST, FIRST + SCHEDULES):
        try:
            steps += await asyncio.wait_for(run_schedule(number, tmp_path), 150)
        except TimeoutError as err:
            raise AssertionError(f"schedule {number} did not finish: a drone is stuck") from err
        explored += 1
    print(f"explored {explored} schedules, {steps} steps")
    assert explored == SCHEDULES
