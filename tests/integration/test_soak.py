"""
Soak: drones start and end continuously while the manager runs; its state stays flat

A live fleet heartbeats throughout, and new drones run whole lives and end, by every path:
drained and exited, drained and silent, released before they came up and given up by
TARDIS, lost and given up by TARDIS. The manager (the service COBalD runs) retires them
after ``retain_ended_s``. Sampled over the run: the registry's size, the manager's own
allocations, the records in the bucket and what a rebuild reads stay bounded by the live
fleet and the retention window while the number of drones run keeps growing; no drone
that ended is ever counted or logged lost.

``COBALD_REMOTE_SOAK_S`` sets the duration (default 60 s; hours for a real soak).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.drones import FakeDrone, publish
from support.manager import running_manager
from support.waiting import wait_until

from broker.manager.rebuild import WINDOW_LOST_AFTER, RebuildReport, rebuild
from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import MSG_ID, Namespace

NS = Namespace()
SITE = "soak"
SOAK_S = float(os.environ.get("COBALD_REMOTE_SOAK_S", "60"))
LOST_AFTER_S = 3.0
RETAIN_S = 2.0
LIVE = 40  #: drones that heartbeat throughout
CYCLE_S = 0.5  #: every cycle: a heartbeat of each live drone, new lives started
PER_CYCLE = 8  #: lives started per cycle


@dataclass
class Sample:
    at: float  #: seconds into the run
    run: int  #: drones whose life was started so far
    views: int
    manager_bytes: int  #: allocations made by the manager's code, still alive
    records: int  #: messages in the bucket's stream
    rebuild_read: int  #: messages a rebuild read
    rebuild_s: float


class Fleet:
    """Drones with uuids ``soak-<10 hex>``; each life one task"""

    def __init__(self, js: JetStreamContext, store: RecordStore, manager: RecordStore) -> None:
        self.js, self.store, self.manager = js, store, manager
        self._numbers = itertools.count(1)
        self.started = 0
        self.ended: set[str] = set()
        self.failures: list[BaseException] = []

    def new(self) -> FakeDrone:
        self.started += 1
        return FakeDrone(SITE, f"{SITE}-{next(self._numbers):010x}")

    async def _tardis_down(self, drone: str) -> None:
        note = ev.TardisState(
            site=SITE, drone=drone, state="DownState", at=ev.utcnow(), id=f"{drone}-down"
        )
        subject = NS.manager_note(SITE, drone, "tardis_state")
        await self.js.publish(subject, ev.encode(note), headers={MSG_ID: note.id})

    async def life(self, n: int) -> None:
        """One whole life, its end chosen by ``n``"""
        drone = self.new()
        uuid = drone.drone
        try:
            if n % 4 == 2:  # released before it came up, then removed by TARDIS
                await self.manager.release(SITE, uuid, note="soak")
                await self._tardis_down(uuid)
                return
            await publish(self.js, NS, drone.started())
            await self.store.claim(SITE, uuid, drone.incarnation)
            await publish(self.js, NS, drone.ready())
            await publish(self.js, NS, drone.payload_started(f"{n}.0"))
            await publish(self.js, NS, drone.heartbeat(interval_s=CYCLE_S))
            await publish(self.js, NS, drone.payload_finished(f"{n}.0"))
            if n % 4 == 3:  # its agent vanished; TARDIS saw the job gone and gave it up
                await self._tardis_down(uuid)
                return
            await self.store.finish(SITE, uuid, drone.incarnation, ev.RecordPhase.DRAINED)
            await publish(self.js, NS, drone.drained())
            if n % 4 == 0:
                await publish(self.js, NS, drone.exiting())
            # n % 4 == 1: drained, then silent
        except Exception as err:  # reported by the test, not swallowed
            self.failures.append(err)
        finally:
            self.ended.add(uuid)


async def _rebuilt(nc: Client, js: JetStreamContext) -> tuple[int, float]:
    registry = Registry(NS, lost_after_s=LOST_AFTER_S, retain_ended_s=RETAIN_S)
    report, _ = await rebuild(nc, js, registry)
    read = report.window_messages + report.drone_messages + report.resolved_messages
    return read + report.records, report.seconds


def _manager_bytes() -> int:
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*/broker/manager/*")]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


async def _every(period_s: float, stop: asyncio.Event, step: Callable[[], Awaitable[None]]) -> None:
    while not stop.is_set():
        await step()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


@pytest.mark.timeout(SOAK_S + 180)
async def test_state_stays_flat_while_drones_come_and_go(
    nats_server: EmbeddedServer,
    nc: Client,
    stream: JetStreamContext,
    store: RecordStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cobald.runtime.cobald_remote.registry")
    settings = ManagerSettings(
        servers=(nats_server.url,),
        lost_after_s=LOST_AFTER_S,
        lost_check_s=0.2,
        retain_ended_s=RETAIN_S,
    )
    tracemalloc.start()
    try:
        async with running_manager(settings) as service:
            samples = await _soak(nc, stream, store, service)
    finally:
        tracemalloc.stop()
    for sample in samples:
        print(sample)
    lost_lines = [r for r in caplog.records if " lost: " in r.getMessage()]
    assert not lost_lines, lost_lines[:3]
    first, last = samples[1], samples[-1]  # the first sample is taken before the fleet settled
    assert last.run >= 4 * first.run, "the number of drones run keeps growing"
    bound_views = LIVE + 3 * PER_CYCLE / CYCLE_S * (RETAIN_S + LOST_AFTER_S + 2)
    for sample in samples[1:]:
        assert sample.views <= bound_views, sample
        assert sample.records <= bound_views, sample
        assert sample.rebuild_read <= 3 * first.rebuild_read + 500, sample
        assert sample.manager_bytes <= 2 * first.manager_bytes + 1_000_000, sample


async def _soak(
    nc: Client, js: JetStreamContext, store: RecordStore, service: ManagerService
) -> list[Sample]:
    assert service.control is not None
    fleet = Fleet(js, store, service.control.store)
    live = [fleet.new() for _ in range(LIVE)]
    for drone in live:
        await publish(js, NS, drone.started())
        await store.claim(SITE, drone.drone, drone.incarnation)
    registry = service.registry
    stop = asyncio.Event()
    lives_over = asyncio.Event()  #: no new lives; the live fleet heartbeats on until ``stop``
    lives: set[asyncio.Task[None]] = set()
    counter = itertools.count()
    never_lost: list[str] = []

    async def cycle() -> None:
        for drone in live:
            await publish(js, NS, drone.heartbeat(interval_s=CYCLE_S))
        if lives_over.is_set():
            return
        for _ in range(PER_CYCLE):
            task = asyncio.create_task(fleet.life(next(counter)))
            lives.add(task)
            task.add_done_callback(lives.discard)

    async def watch() -> None:
        metrics = registry.metrics()
        if metrics.lost:
            never_lost.extend(v.drone for v in registry.views().values() if v.lost)

    samples: list[Sample] = []
    started = time.monotonic()

    async def sample() -> None:
        read, seconds = await _rebuilt(nc, js)
        info = await js.stream_info(NS.record_stream)
        samples.append(
            Sample(
                at=round(time.monotonic() - started, 1),
                run=fleet.started - LIVE,
                views=len(registry),
                manager_bytes=_manager_bytes(),
                records=info.state.messages,
                rebuild_read=read,
                rebuild_s=round(seconds, 3),
            )
        )

    sampling = asyncio.create_task(_every(SOAK_S / 8, lives_over, sample))
    tasks = [
        asyncio.create_task(_every(CYCLE_S, stop, cycle)),
        asyncio.create_task(_every(0.25, stop, watch)),
    ]
    try:
        await asyncio.sleep(SOAK_S)
        lives_over.set()
        await sampling
        await asyncio.gather(*lives)
        await sample()  # with the live fleet still heartbeating: none of it is lost
    finally:
        lives_over.set()
        stop.set()
        await asyncio.gather(sampling, *tasks, *lives)
    assert not fleet.failures, fleet.failures[:3]
    assert not never_lost, f"counted lost: {sorted(set(never_lost))[:5]}"
    assert service.retired.retired >= len(fleet.ended) // 2
    return samples


async def _rebuild_like(
    service: ManagerService, nc: Client, js: JetStreamContext
) -> tuple[RebuildReport, Registry]:
    live = service.registry
    registry = Registry(NS, lost_after_s=live.lost_after_s, retain_ended_s=RETAIN_OUTSIDE_S)
    registry.proof_key = live.proof_key
    report, _ = await rebuild(nc, js, registry)
    return report, registry


LOST_OUTSIDE_S = 2.0
#: longer than the rebuild window, as the default retention is
RETAIN_OUTSIDE_S = 12.0
OUTSIDE_LIVES = 16


@pytest.mark.timeout(120)
async def test_retained_drones_outside_the_window_are_read_one_by_one(
    nats_server: EmbeddedServer, nc: Client, stream: JetStreamContext, store: RecordStore
) -> None:
    """
    Ended drones kept longer than the rebuild window: each is read one by one, ends the same
    in the rebuilt registry, and costs the rebuild nothing once retired
    """
    settings = ManagerSettings(
        servers=(nats_server.url,),
        lost_after_s=LOST_OUTSIDE_S,
        lost_check_s=0.2,
        retain_ended_s=RETAIN_OUTSIDE_S,
    )
    window_s = WINDOW_LOST_AFTER * LOST_OUTSIDE_S
    assert window_s + 5 < RETAIN_OUTSIDE_S
    stop = asyncio.Event()
    async with running_manager(settings) as service:
        assert service.control is not None
        fleet = Fleet(stream, store, service.control.store)
        live = [fleet.new() for _ in range(5)]
        for drone in live:
            await publish(stream, NS, drone.started())
            await store.claim(SITE, drone.drone, drone.incarnation)

        async def heartbeats() -> None:
            for drone in live:
                await publish(stream, NS, drone.heartbeat(interval_s=0.25))

        beating = asyncio.create_task(_every(0.25, stop, heartbeats))
        try:
            await asyncio.gather(*(fleet.life(n) for n in range(OUTSIDE_LIVES)))
            assert not fleet.failures, fleet.failures[:3]
            # every message of the ended drones is older than the window, their retention
            # is not over
            await asyncio.sleep(window_s + 1)
            assert service.registry.metrics().ended == OUTSIDE_LIVES
            report, rebuilt = await _rebuild_like(service, nc, stream)
            assert report.drones_read == OUTSIDE_LIVES
            kept = {key: v for key, v in service.registry.views().items() if v.ended}
            # what status --ended, timeline and the retirement time derive from
            assert {key: rebuilt.views()[key] for key in kept} == kept
            assert not rebuilt.mark_lost(time.time()), "an ended drone is never lost"
            await wait_until(
                lambda: service.retired.retired >= OUTSIDE_LIVES,
                RETAIN_OUTSIDE_S + 30,
                "the retained drones retired",
            )
            report, rebuilt = await _rebuild_like(service, nc, stream)
            assert (report.drones_read, len(rebuilt)) == (0, len(live))
        finally:
            stop.set()
            await beating
