"""
A drone that floods the bus with valid events of its own, on its own credentials

While it flips its facts as fast as it can, other drones come up and go down, and real TARDIS
event-driven drones follow each of them; the noisy drone's TARDIS drone runs within its
budget; the noisy drone shows as noisy in ``cobald-remote status`` and in the metrics; and
once it stops, its newest event is its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.buses import running_buses
from support.drones import FakeDrone, publish
from support.metrics import scrape
from support.processes import CLI, run_process
from support.servers import drone_creds
from support.tardis import SITE, Rig, drone_running, rig
from support.waiting import wait_until

from broker.manager.budget import EVENT_BUDGET, Budget
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import MSG_ID, Namespace

pytestmark = pytest.mark.timeout(240)

NS = Namespace()
NOISY = "site1-00000000ff"
HONEST = [f"site1-00000000{n}0" for n in range(1, 4)]
#: the noisy drone's TARDIS state runs: its flood goes beyond it at once
RUN_BUDGET = Budget(per_s=5.0, burst=5)


class Flooder:
    """A drone's own connection publishing valid events that flip its state, without acks"""

    def __init__(self, nc: Client, drone: FakeDrone) -> None:
        self.nc = nc
        self.drone = drone
        self.sent = 0
        self.last: ev.Event | None = None

    async def run(self, stop: asyncio.Event) -> None:
        drone = self.drone
        while not stop.is_set():
            for _ in range(200):
                if drone.payloads:
                    event = drone.payload_finished(drone.payloads[0].job_id)
                else:
                    event = drone.payload_started(f"{self.sent}.0")
                subject = drone.subject(event, NS)
                await self.nc.publish(subject, ev.encode(event), headers={MSG_ID: event.id})
                self.sent += 1
                self.last = event
            await self.nc.flush()


async def _up(js: JetStreamContext, store: RecordStore, one: Rig) -> None:
    """The agent comes up as an agent does: its record, then its events"""
    agent = one.agent
    await store.claim(SITE, agent.drone, agent.incarnation)
    for event in (agent.started(), agent.ready()):
        await publish(js, NS, event)


async def _down(js: JetStreamContext, store: RecordStore, one: Rig) -> None:
    """The agent drains, records it and exits: its job ends by itself"""
    agent = one.agent
    await publish(js, NS, agent.drained())
    await store.finish(SITE, agent.drone, agent.incarnation, ev.RecordPhase.DRAINED)
    await publish(js, NS, agent.exiting())


async def test_a_noisy_drone_slows_no_other_and_loses_none_of_its_facts(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "cobald.runtime.cobald_remote")
    server, authority_file = secured
    manager_creds = tmp_path / "manager.creds"
    async with contextlib.AsyncExitStack() as stack:
        make = await stack.enter_async_context(running_buses(server.url))
        bus = await make(creds=str(manager_creds), metrics="127.0.0.1:0")
        nc = await connect(server.url, user_credentials=str(manager_creds))
        stack.push_async_callback(close, nc)
        js = nc.jetstream()
        store = await RecordStore.open(js, NS)
        own = await connect(
            server.url,
            user_credentials=str(drone_creds(tmp_path, authority_file, SITE, NOISY)),
            inbox_prefix=f"_INBOX_{NOISY}",
        )
        stack.push_async_callback(close, own)

        loud = rig(bus, NOISY, budget=RUN_BUDGET)
        honest = [rig(bus, uuid) for uuid in HONEST]
        for one in (loud, *honest):
            await stack.enter_async_context(drone_running(one.drone))
        # the noisy drone comes up as any drone does, on its own credentials
        await _up(own.jetstream(), store, loud)
        await wait_until(lambda: "AvailableState" in loud.recorder.states, 30, "noisy: Available")

        loop = asyncio.get_running_loop()
        flooder = Flooder(own, loud.agent)
        stop = asyncio.Event()
        flood = asyncio.create_task(flooder.run(stop))
        flood_started, runs_before = loop.time(), loud.drone.state_runs
        try:
            await wait_until(
                lambda: (SITE, NOISY) in bus.registry.noisy(time.time()), 60, "noisy by events"
            )
            # well into the flood: many times its budget coalesced already
            await wait_until(
                lambda: bus.registry.metrics().coalesced > 5 * EVENT_BUDGET.burst, 60, "a flood"
            )
            # the other drones' TARDIS states follow their agents' events meanwhile
            for one in honest:
                await _up(js, store, one)
            for one in honest:
                await wait_until(
                    lambda one=one: "AvailableState" in one.recorder.states, 60, "Available"
                )
            for one in honest:
                await _down(js, store, one)
            for one in honest:
                await wait_until(
                    lambda one=one: one.recorder.states[-1:] == ["DownState"], 60, "Down"
                )
            # its woken runs go on at the budget's pace, no faster, whatever the flood
            await wait_until(
                lambda: loud.drone.state_runs - runs_before >= 3 * RUN_BUDGET.burst,
                60,
                "the noisy drone's state runs",
            )
            assert loud.drone.delayed > 0
            assert [one.drone.delayed for one in honest] == [0] * len(honest)
            runs = loud.drone.state_runs - runs_before
            elapsed_s = loop.time() - flood_started
            assert runs <= RUN_BUDGET.burst + RUN_BUDGET.per_s * elapsed_s + 1

            assert bus.metrics is not None
            samples = await scrape(bus.metrics.port)
            assert samples[("cobald_remote_drones_noisy", (("budget", "events"),))] == 1
            assert samples[("cobald_remote_drones_noisy", (("budget", "state_runs"),))] == 1
            coalesced = ("cobald_remote_registry_events_total", (("outcome", "coalesced"),))
            assert samples[coalesced] > 0
            assert samples[("cobald_remote_tardis_state_runs_delayed_total", ())] > 0

            status = ("status", "--ended", "--json", "--server", server.url)
            code, out, err = await run_process(*CLI, *status, "--creds", manager_creds)
            assert code == 0, err
            rows = {row["drone"]: row for row in json.loads(out)}
            assert rows[NOISY]["noisy"] is True and rows[NOISY]["noisy_at"] is not None
            assert [rows[uuid]["noisy"] for uuid in HONEST] == [False] * len(HONEST)
            assert all(rows[uuid]["ended"] for uuid in HONEST)
        finally:
            stop.set()
            await flood

        # nothing lost: once the flood stops, its newest event is its state
        assert flooder.last is not None and flooder.sent > 10 * RUN_BUDGET.burst
        newest = ev.encode(flooder.last)
        await wait_until(
            lambda: (view := bus.registry.view(SITE, NOISY)) is not None and view.encoded == newest,
            30,
            "the newest event applied",
        )
        assert bus.registry.accounts.holding((SITE, NOISY)) is None
        assert bus.registry.metrics().coalesced > 5 * EVENT_BUDGET.burst
        # the log names it, once for each budget (one line a minute at most)
        told = [r.getMessage() for r in caplog.records if "over its budget" in r.getMessage()]
        assert [line.split(" is over")[0] for line in told] == [f"drone {SITE}/{NOISY}"] * 2
        budgets = {line.split("budget of ")[1].split(" (")[0] for line in told}
        assert budgets == {"events", "TARDIS state runs"}
