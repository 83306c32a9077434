"""RemoteFactoryPool: drones without payloads are released before drones with payloads

The order among drones with payloads: ``tests/unit/test_release_choice.py``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

from support.clock import FakeClock
from support.registry import jobs_gone
from support.tardis import SITE, announce, offline_bus

from broker.tardis import pool as pool_module
from broker.tardis.pool import PeakWindow
from broker.tardis_adapter import RemoteBus, RemoteFactoryPool
from remote_agent.protocol import events as ev


class Child:
    """What FactoryPool reads of a TARDIS Drone: plain attributes"""

    def __init__(self, drone: str, supply: float = 0.0, utilisation: float = 0.0) -> None:
        self.resource_attributes = {"drone_uuid": drone}
        self.demand = 2.0
        self.supply = supply
        self.utilisation = utilisation
        self.allocation = utilisation


def _pool(bus: RemoteBus, children: list[Child]) -> RemoteFactoryPool:
    return RemoteFactoryPool(
        *children, factory=lambda: Child("site1-ffffffffff"), interval=1, bus=bus, site=SITE
    )


def _released(children: list[Child]) -> list[str]:
    return [c.resource_attributes["drone_uuid"] for c in children if c.demand == 0]


def _fleet(bus: RemoteBus) -> dict[str, Child]:
    # supply x utilisation (COBalD's own order) would pick "busy2" and "busy1" first:
    # they look idle in TARDIS's stale view; their agents know better
    children = {
        "busy2": Child("site1-0000000002", supply=2, utilisation=0.0),
        "busy1": Child("site1-0000000001", supply=2, utilisation=0.0),
        "idle": Child("site1-000000000a", supply=2, utilisation=0.9),
        "booting": Child("site1-000000000b"),
        "released": Child("site1-000000000c"),
    }
    announce(bus.registry, "site1-0000000002", ev.DroneState.BUSY, payloads=2)
    announce(bus.registry, "site1-0000000001", ev.DroneState.BUSY, payloads=1)
    announce(bus.registry, "site1-000000000a", ev.DroneState.IDLE)
    # only a handshake record (the manager released it): no agent ever announced
    bus.registry.apply_record(
        ev.DroneRecord(
            site=SITE,
            drone="site1-000000000c",
            phase=ev.RecordPhase.RELEASED,
            writer="manager",
            at=ev.utcnow(),
        ),
        1,
        None,
    )
    return children


def test_release_order_never_announced_then_idle_then_busy() -> None:
    bus = offline_bus()
    children = _fleet(bus)
    pool = _pool(bus, list(children.values()))
    order = sorted(children, key=lambda name: pool.release_key(children[name]))
    assert set(order[:2]) == {"booting", "released"}
    assert order[2] == "idle"
    assert set(order[3:]) == {"busy1", "busy2"}


def test_shrinking_releases_drones_without_payloads_first() -> None:
    bus = offline_bus()
    children = _fleet(bus)
    pool = _pool(bus, list(children.values()))
    pool._shrink(target=4.0)  # 10 demanded, 4 wanted: three drones go
    assert set(_released(list(children.values()))) == {
        "site1-000000000b",
        "site1-000000000c",
        "site1-000000000a",
    }
    pool._shrink(target=2.0)
    assert sorted(children[name].demand for name in ("busy1", "busy2")) == [0, 2.0]


def test_release_key_runs_in_another_thread_while_the_registry_changes() -> None:
    # COBalD calls _shrink in its trio thread while the asyncio side applies events
    bus = offline_bus()
    children = [Child(f"site1-{i:010x}", supply=2) for i in range(200)]
    pool = _pool(bus, children)
    errors: list[BaseException] = []
    keys: list[Any] = []

    def shrink() -> None:
        try:
            for _ in range(50):
                keys.append([pool.release_key(c) for c in children])
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    thread = threading.Thread(target=shrink)
    thread.start()
    for seq in range(1, 30):
        for i in range(0, 200, 7):
            announce(bus.registry, f"site1-{i:010x}", ev.DroneState.BUSY, payloads=1, seq=seq)
    thread.join(30)
    assert not errors
    assert len(keys) == 50


def test_without_a_bus_it_is_cobalds_order() -> None:
    children = [Child("site1-0000000001", 2, 0.5), Child("site1-0000000002", 2, 0.1)]
    pool = RemoteFactoryPool(*children, factory=lambda: Child("x-y"), interval=1)
    assert sorted(children, key=pool.release_key)[0] is children[1]


def test_a_dip_shorter_than_the_window_releases_nothing_a_lasting_one_the_cheapest() -> None:
    """Kubernetes' scale-down stabilization: shrink to the highest demand of the window"""
    bus = offline_bus()
    children = _fleet(bus)  # five drones of 2 cores: 10 demanded
    pool = _pool(bus, list(children.values()))
    now = FakeClock()
    pool.window = PeakWindow(300.0, now)
    pool.demand = 10.0
    now.now = 100.0
    pool.demand = 4.0  # the controller lowers the demand for a while
    now.now = 250.0
    pool.demand = 8.0  # and raises it again
    for now.now in (260.0, 399.0):  # the 10 of before 100 s is still in the window
        pool._shrink(target=pool.demand)
        assert _released(list(children.values())) == []
    now.now = 420.0  # the window holds 4 (in effect at its start) and 8: one drone goes
    pool._shrink(target=pool.demand)
    assert set(_released(list(children.values()))) <= {"site1-000000000b", "site1-000000000c"}
    assert len(_released(list(children.values()))) == 1
    now.now = 600.0
    pool.demand = 4.0  # a lasting dip: after the window, down to 4, cheapest first
    now.now = 899.0
    pool._shrink(target=pool.demand)
    assert len(_released(list(children.values()))) == 1
    now.now = 900.0
    pool._shrink(target=pool.demand)
    assert set(_released(list(children.values()))) == {
        "site1-000000000b",
        "site1-000000000c",
        "site1-000000000a",
    }


def test_without_a_window_it_shrinks_to_the_demand_now() -> None:
    window = PeakWindow(0.0)
    window.seen(10.0)
    window.seen(4.0)
    assert window.highest(4.0) == 4.0


def test_of_the_drones_still_queued_the_one_that_waited_least_goes_first() -> None:
    """A release gives up a queued drone's place in the site's queue: the newest is cheapest"""
    bus = offline_bus()
    now = dt.datetime.now()
    old, new = Child("site1-00000000a1"), Child("site1-00000000a2")
    old.resource_attributes["created"] = now - dt.timedelta(hours=3)  # type: ignore[assignment]
    new.resource_attributes["created"] = now - dt.timedelta(minutes=1)  # type: ignore[assignment]
    pool = _pool(bus, [old, new])
    assert pool.release_key(new) < pool.release_key(old)
    waited = pool.release_key(new).waited_s
    assert 59 <= waited < 120 and pool.release_key(old).waited_s >= 3 * 3600 - 1
    pool._shrink(target=2.0)
    assert _released([old, new]) == ["site1-00000000a2"]


def test_a_black_hole_site_grows_by_one_probe_per_period_a_healthy_one_as_it_needs() -> None:
    bus = offline_bus(black_hole_backoff_s=10.0, black_hole_backoff_max_s=40.0)
    made: list[Child] = []

    def factory() -> Child:
        made.append(Child(f"site1-{len(made):010x}"))
        return made[-1]

    pool = RemoteFactoryPool(factory=factory, interval=1, bus=bus, site=SITE)
    other = RemoteFactoryPool(factory=lambda: Child("site2-ffffffffff"), bus=bus, site="site2")
    jobs_gone(bus.registry, SITE)
    assert SITE in bus.black_holes.flags
    clock = FakeClock(1000.0)
    with monkeypatch_clock(clock):
        pool._grow(target=10.0)  # five drones wanted: none before the first period
        assert made == []
        clock.advance(10.0)
        pool._grow(target=10.0)
        assert len(made) == 1  # one probe
        pool._grow(target=10.0)
        assert len(made) == 1
        clock.advance(19.0)
        pool._grow(target=10.0)
        assert len(made) == 1  # the period doubled to 20 s
        clock.advance(1.0)
        pool._grow(target=10.0)
        assert len(made) == 2
        other._grow(target=6.0)  # another site is not touched
        assert len(other.children) == 3
        # a payload starts on the site: the flag clears, the pool grows as COBalD's
        announce(bus.registry, "site1-0000000000", ev.DroneState.BUSY, payloads=1)
        assert SITE not in bus.black_holes.flags
        pool._grow(target=10.0)
        assert len(made) == 5
    assert bus.black_holes.probes[SITE] == 2


@contextlib.contextmanager
def monkeypatch_clock(clock: FakeClock) -> Iterator[None]:
    """The pool's monotonic clock reads ``clock`` for the block"""
    real = pool_module.time.monotonic
    pool_module.time.monotonic = clock  # type: ignore[assignment]
    try:
        yield
    finally:
        pool_module.time.monotonic = real  # type: ignore[assignment]


def _created(child: Child, seconds_ago: float) -> Child:
    """``child`` as TARDIS requested it ``seconds_ago``"""
    when = dt.datetime.now() - dt.timedelta(seconds=seconds_ago)
    child.resource_attributes["created"] = when  # type: ignore[assignment]
    return child


def test_a_drone_that_ends_before_a_new_one_starts_is_replaced_before_it_is_released() -> None:
    """Make before break: the replacement is asked for while the ending drone still works"""
    bus = offline_bus()
    made: list[Child] = []

    def factory() -> Child:
        made.append(Child(f"site1-{0xF0 + len(made):010x}"))
        return made[-1]

    ending = Child("site1-0000000001", supply=2, utilisation=0.0)
    steady = Child("site1-0000000002", supply=2, utilisation=1.0)
    far = Child("site1-0000000003", supply=2, utilisation=1.0)
    announce(bus.registry, "site1-0000000001", ev.DroneState.IDLE, end=ev.DroneEnd(in_s=300.0))
    announce(bus.registry, "site1-0000000002", ev.DroneState.BUSY, payloads=2)
    announce(
        bus.registry,
        "site1-0000000003",
        ev.DroneState.BUSY,
        payloads=2,
        end=ev.DroneEnd(in_s=7200.0),
    )
    pool = RemoteFactoryPool(
        ending, steady, far, factory=factory, interval=1, bus=bus, site=SITE, start_s=600.0
    )
    pool.demand = 6.0
    # COBalD's pool would see its demand met; the ending drone's end comes before a new
    # drone's start (600 s), so it no longer counts
    pool._grow(target=pool.demand)
    assert len(made) == 1 and ending.demand == 2.0
    assert pool.supply == 4.0
    assert pool.utilisation == 1.0 and pool.allocation == 1.0  # its idle slots drag nothing
    pool._grow(target=pool.demand)  # the replacement boots: nothing more, nothing released
    assert len(made) == 1 and ending.demand == 2.0
    made[0].supply = 2.0  # TARDIS sees the replacement available: now the old one goes
    pool._grow(target=pool.demand)
    assert _released([ending, steady, far, *made]) == ["site1-0000000001"]
    assert bus.release_reasons["site1-0000000001"].startswith(
        "chosen for release: its drone ends in 300s, before a new drone would start and run "
        "a payload (600s), and the drones that replace it are up"
    )


def test_an_ending_drone_goes_at_once_when_the_demand_falls_and_counts_for_nothing() -> None:
    bus = offline_bus()
    ending = Child("site1-0000000001", supply=2)
    steady = Child("site1-0000000002", supply=2, utilisation=1.0)
    announce(
        bus.registry,
        "site1-0000000001",
        ev.DroneState.BUSY,
        payloads=1,
        end=ev.DroneEnd(in_s=30.0, notice="SIGTERM"),
    )
    announce(bus.registry, "site1-0000000002", ev.DroneState.BUSY, payloads=2)
    pool = _pool(bus, [ending, steady])
    pool._shrink(target=2.0)  # the steady drone covers the demand: the ending one goes
    assert _released([ending, steady]) == ["site1-0000000001"]
    pool._shrink(target=0.0)
    assert _released([ending, steady]) == ["site1-0000000001", "site1-0000000002"]


def test_a_booting_drone_or_one_with_a_distant_end_counts_as_before() -> None:
    """Only supply can be ending: a walltime shorter than a start asks for no stream of drones"""
    bus = offline_bus()
    made: list[Child] = []

    def factory() -> Child:
        made.append(Child(f"site1-{0xF0 + len(made):010x}"))
        return made[-1]

    booting = Child("site1-0000000001")  # its agent spoke, TARDIS does not count it yet
    later = Child("site1-0000000002", supply=2, utilisation=1.0)
    announce(
        bus.registry, "site1-0000000001", ev.DroneState.STARTD_READY, end=ev.DroneEnd(in_s=60.0)
    )
    announce(
        bus.registry,
        "site1-0000000002",
        ev.DroneState.BUSY,
        payloads=2,
        end=ev.DroneEnd(in_s=601.0),
    )
    pool = RemoteFactoryPool(
        booting, later, factory=factory, interval=1, bus=bus, site=SITE, start_s=600.0
    )
    for _ in range(3):
        pool._grow(target=4.0)
    assert made == [] and _released([booting, later]) == []
    assert pool.supply == 2.0


def test_the_start_is_measured_from_the_pools_own_drones() -> None:
    """From TARDIS's request until TARDIS counts the drone: the 90th percentile of the newest"""
    bus = offline_bus()
    restored = _created(Child("site1-00000000aa", supply=2), 86_400)  # not the pool's start
    pool = RemoteFactoryPool(
        restored,
        factory=lambda: Child("site1-ffffffffff"),
        interval=1,
        bus=bus,
        site=SITE,
        start_s=600.0,
    )
    children = [_created(Child(f"site1-{i:010x}"), 10.0 * (i + 1)) for i in range(10)]
    pool._hatchery.update(children)
    pool._grow(target=pool.demand)
    assert pool.start.estimate_s == 600.0  # none became supply yet: the default
    for child in children[:2]:
        child.supply = 2.0
    pool._grow(target=pool.demand)
    assert pool.start.estimate_s == 600.0  # two seen: still the default
    for child in children[2:]:
        child.supply = 2.0
    pool._grow(target=pool.demand)
    assert 80.0 <= pool.start.estimate_s < 120.0  # 9th of 10 starts of 10 to 100 s
    pool._grow(target=pool.demand)  # each drone is measured once
    assert 80.0 <= pool.start.estimate_s < 120.0
    # an ending drone is judged by the measured start, no longer by the default
    announce(bus.registry, "site1-0000000000", ev.DroneState.IDLE, end=ev.DroneEnd(in_s=300.0))
    pool._grow(target=pool.demand)
    assert _released(children) == []
    announce(
        bus.registry, "site1-0000000000", ev.DroneState.IDLE, seq=2, end=ev.DroneEnd(in_s=60.0)
    )
    pool._grow(target=pool.demand - 2.0)
    assert _released(children) == ["site1-0000000000"]


def test_a_drone_is_replaced_a_payloads_mean_runtime_earlier() -> None:
    """Its gate lets in only payloads that end in time: its slots empty a payload before its end"""
    bus = offline_bus()
    drone = Child("site1-0000000001", supply=2)
    announce(bus.registry, "site1-0000000001", ev.DroneState.IDLE, end=ev.DroneEnd(in_s=150.0))
    pool = RemoteFactoryPool(
        drone,
        factory=lambda: Child("site1-ffffffffff"),
        interval=1,
        bus=bus,
        site=SITE,
        start_s=60.0,
    )
    pool._grow(target=2.0)
    assert pool.lead_s == 60.0 and pool.supply == 2.0  # too few payload ends seen
    for _ in range(5):
        bus.durations.add(100.0)
    pool._grow(target=2.0)
    assert pool.lead_s == 160.0 and pool.supply == 0.0  # 150 s left: ending
    assert len(pool.children) == 2
