"""
A fleet of fake drones, the story each publishes, and the state a registry should reach
from it, for the tests that feed the registry from a real stream
"""

from __future__ import annotations

from nats.js import JetStreamContext

from broker.jetstream.messages import PullSettings
from broker.manager.registry import Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace
from support.drones import FakeDrone, publish

NS = Namespace()
SITE = "site1"
#: pull settings that keep the tests short
FAST = PullSettings(batch=50, expires_s=2.0, idle_heartbeat_s=0.5)


def fleet(count: int, prefix: str = "site1-") -> list[FakeDrone]:
    return [FakeDrone(SITE, f"{prefix}{i:010x}") for i in range(count)]


async def publish_story(js: JetStreamContext, drone: FakeDrone, steps: int) -> None:
    await publish(js, NS, drone.started())
    await publish(js, NS, drone.ready())
    for step in range(steps):
        if step % 3 == 1:
            await publish(js, NS, drone.payload_started(f"{drone.drone}.{step}"))
        elif step % 3 == 2 and drone.payloads:
            await publish(js, NS, drone.payload_finished(drone.payloads[0].job_id))
        else:
            await publish(js, NS, drone.heartbeat())


def expected(drones: list[FakeDrone]) -> dict[tuple[str, str], tuple[int, ev.DroneState]]:
    return {(d.site, d.drone): (d.seq, d.state) for d in drones}


def state_of(registry: Registry) -> dict[tuple[str, str], tuple[int | None, ev.DroneState | None]]:
    return {
        key: (view.seq, view.state)
        for key, view in registry.views().items()
        if view.seq is not None  # drones known only from their record have no events
    }
