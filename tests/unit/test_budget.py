"""
A drone's budget of applied events: beyond it only its newest event waits, and none is lost

The registry is fed as the consumer's handler feeds it (``now`` given: events beyond the
budget are held) and as the rebuild does (``now`` not given); held events are released by
:meth:`Registry.release_held`. The handler's own timer is tested on a running loop; the
waker's count of TARDIS state runs that waited for their budget last.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import FakeClock
from support.drones import FakeDrone
from support.registry import NS, SITE, event_subject
from support.waiting import wait_until

from broker.manager.budget import EVENT_BUDGET, NOISY_FOR_S, Accounts, Budget
from broker.manager.handler import event_handler
from broker.manager.registry import Applied, Registry
from broker.tardis.wake import Waker
from remote_agent.protocol import events as ev
from remote_agent.protocol.fields import MAX_PAYLOADS

#: three at once, then ten a second: small enough to go over in a test
SMALL = Budget(per_s=10.0, burst=3)
DRONE = "site1-0000000001"
OTHER = "site1-0000000002"
T0 = 1_800_000_000.0


def _offer(
    registry: Registry, event: ev.Event, stored: float, stream_seq: int, now: float | None = 0.0
) -> Applied:
    """``event`` as the consumer's handler offers it (``now=None``: as the rebuild reads it)"""
    return registry.apply_message(
        ev.encode(event), event_subject(event), stored, stream_seq, now=now
    )


def _flips(drone: FakeDrone, count: int) -> list[ev.Event]:
    """A drone flipping between busy and idle: each event changes what TARDIS reads"""
    events = []
    for i in range(count):
        if i % 2:
            events.append(drone.payload_finished(f"{i - 1}.0"))
        else:
            events.append(drone.payload_started(f"{i}.0"))
    return events


def _release_all(registry: Registry) -> None:
    while registry.next_release is not None:
        registry.release_held(math.inf)


def test_a_budget_lets_a_burst_through_then_its_rate() -> None:
    budget = Budget(per_s=10.0, burst=3)
    due = -math.inf
    for _ in range(3):  # the burst, at one moment
        assert budget.wait_s(due, 100.0) == 0.0
        due = budget.spent(due, 100.0)
    assert budget.wait_s(due, 100.0) == pytest.approx(0.1)
    assert budget.wait_s(due, 100.1) == pytest.approx(0.0)
    assert budget.interval_s == pytest.approx(0.1)
    # a full bucket after a pause: the burst again, not more
    due = budget.spent(due, 200.0)
    assert budget.wait_s(due, 200.0) == 0.0
    with pytest.raises(ValueError, match="per_s"):
        Budget(per_s=0.0, burst=1)
    with pytest.raises(ValueError, match="per_s"):
        Budget(per_s=math.inf, burst=1)
    with pytest.raises(ValueError, match="burst"):
        Budget(per_s=1.0, burst=0)


def test_the_default_budget_fits_the_largest_honest_drone() -> None:
    """Every slot of the largest drone starting a payload at once is within the budget"""
    registry = Registry(NS)
    drone = FakeDrone(SITE, DRONE)
    seq = 0
    for event in (drone.started(), drone.ready()):
        seq += 1
        assert _offer(registry, event, T0, seq) is Applied.APPLIED
    for i in range(MAX_PAYLOADS):  # within 2.56 s of bus time
        seq += 1
        event = drone.payload_started(f"{i}.0")
        assert _offer(registry, event, T0 + i / 100, seq) is Applied.APPLIED
    assert EVENT_BUDGET.burst > MAX_PAYLOADS + 2
    assert registry.noisy(T0 + 3) == {}


def test_beyond_the_budget_the_newest_event_waits_and_none_is_lost() -> None:
    registry = Registry(NS, budget=SMALL)
    drone = FakeDrone(SITE, DRONE)
    events = _flips(drone, 10)
    results = [_offer(registry, e, T0 + n / 1000, n + 1, now=5.0) for n, e in enumerate(events)]
    assert results == [Applied.APPLIED] * 3 + [Applied.HELD] * 7
    view = registry.view(SITE, DRONE)
    assert view is not None and view.stream_seq == 3  # the burst
    # held: only the newest, applied one interval after the burst at the latest
    assert registry.next_release is not None and registry.next_release <= 5.0 + 0.1
    assert registry.release_held(registry.next_release) is None
    view = registry.view(SITE, DRONE)
    assert view is not None
    assert (view.stream_seq, view.seq, view.state) == (10, events[-1].seq, ev.DroneState.IDLE)
    metrics = registry.metrics()
    assert (metrics.applied, metrics.coalesced) == (4, 6)
    assert registry.noisy(T0 + 1) == {(SITE, DRONE): T0 + 9 / 1000}
    assert registry.noisy(T0 + NOISY_FOR_S + 1) == {}


def test_an_event_within_the_budget_supersedes_the_held_one() -> None:
    registry = Registry(NS, budget=SMALL)
    drone = FakeDrone(SITE, DRONE)
    events = _flips(drone, 5)
    for n, event in enumerate(events[:4]):
        _offer(registry, event, T0, n + 1)
    assert registry.accounts.holding((SITE, DRONE)) is not None
    # a tenth of a second of bus time later the budget has room for one again
    assert _offer(registry, events[4], T0 + 0.1, 5) is Applied.APPLIED
    assert registry.accounts.holding((SITE, DRONE)) is None
    assert registry.release_held(math.inf) is None  # nothing left to apply
    view = registry.view(SITE, DRONE)
    assert view is not None and view.stream_seq == 5
    assert registry.metrics().coalesced == 1


def test_redeliveries_of_held_and_older_events() -> None:
    registry = Registry(NS, budget=SMALL)
    drone = FakeDrone(SITE, DRONE)
    events = _flips(drone, 3)
    beat = drone.heartbeat(interval_s=7)
    newest = drone.payload_started("9.0")
    for n, event in enumerate(events):
        _offer(registry, event, T0, n + 1)
    assert _offer(registry, newest, T0, 5) is Applied.HELD
    assert _offer(registry, newest, T0, 5) is Applied.DUPLICATE
    # stored before the held event: stale, but the heartbeat's facts are kept with it
    assert _offer(registry, beat, T0, 4) is Applied.STALE
    _release_all(registry)
    view = registry.view(SITE, DRONE)
    assert view is not None
    assert (view.stream_seq, view.kind) == (5, "payload_started")
    assert (view.heartbeat_stream_seq, view.heartbeat_interval_s) == (4, 7.0)


def test_a_heartbeat_superseded_while_held_keeps_its_facts() -> None:
    registry = Registry(NS, budget=SMALL)
    drone = FakeDrone(SITE, DRONE)
    for n, event in enumerate(_flips(drone, 3)):
        _offer(registry, event, T0, n + 1)
    assert _offer(registry, drone.heartbeat(interval_s=9), T0, 4) is Applied.HELD
    assert _offer(registry, drone.payload_started("7.0"), T0, 5) is Applied.HELD
    # and once more superseded by an event the budget lets through at once
    assert _offer(registry, drone.payload_started("8.0"), T0 + 1, 6) is Applied.APPLIED
    view = registry.view(SITE, DRONE)
    assert view is not None
    assert (view.stream_seq, view.heartbeat_stream_seq, view.heartbeat_interval_s) == (6, 4, 9.0)
    assert registry.metrics().coalesced == 2


def test_other_drones_keep_their_own_budget() -> None:
    registry = Registry(NS, budget=SMALL)
    loud, quiet = FakeDrone(SITE, DRONE), FakeDrone(SITE, OTHER)
    seq = 0
    for event in _flips(loud, 20):
        seq += 1
        _offer(registry, event, T0, seq)
    for event in (quiet.started(), quiet.ready(), quiet.payload_started("1.0")):
        seq += 1
        assert _offer(registry, event, T0, seq) is Applied.APPLIED
    assert set(registry.noisy(T0)) == {(SITE, DRONE)}


def test_the_rebuild_applies_everything_and_finds_the_same_drone_noisy() -> None:
    """Read in stream order without ``now``: nothing held, the same flood judged noisy"""
    drone = FakeDrone(SITE, DRONE)
    stream = [(e, T0 + n / 1000, n + 1) for n, e in enumerate(_flips(drone, 30))]
    live, rebuilt = Registry(NS, budget=SMALL), Registry(NS, budget=SMALL)
    for event, stored, seq in stream:
        _offer(live, event, stored, seq)
        assert _offer(rebuilt, event, stored, seq, now=None) is Applied.APPLIED
    _release_all(live)
    assert dict(live.views()) == dict(rebuilt.views())
    assert live.noisy(T0 + 1).keys() == rebuilt.noisy(T0 + 1).keys() == {(SITE, DRONE)}


def test_a_drone_whose_event_is_held_is_not_retired() -> None:
    registry = Registry(NS, budget=SMALL, retain_ended_s=1.0)
    drone = FakeDrone(SITE, DRONE)
    for n, event in enumerate(_flips(drone, 3)):
        _offer(registry, event, T0, n + 1)
    note = ev.TardisState(
        site=SITE, drone=DRONE, state="DownState", resource_status="Deleted", at=ev.utcnow(), id="n"
    )
    subject = NS.manager_note(SITE, DRONE, "tardis_state")
    assert registry.apply_note_message(ev.encode(note), subject, T0, 4) is Applied.APPLIED
    assert _offer(registry, drone.heartbeat(), T0, 5) is Applied.HELD  # it speaks again
    registry.mark_ended(T0 + 1)
    view = registry.view(SITE, DRONE)
    assert view is not None and view.ended == "removed"
    assert not registry.retirable(view)
    assert not registry.retire(view)
    _release_all(registry)
    registry.mark_ended(T0 + 2)
    view = registry.view(SITE, DRONE)
    assert view is not None and (view.stream_seq, view.ended) == (5, "")


def test_accounts_follow_the_drones_that_just_spoke_not_the_fleet() -> None:
    accounts = Accounts(SMALL)
    for n in range(20_000):  # every drone once, a millisecond apart
        assert accounts.charge((SITE, f"site1-{n:010x}"), T0 + n / 1000)
    assert len(accounts) <= 2048


_KINDS = st.sampled_from(["heartbeat", "started", "finished", "drained"])


@settings(max_examples=200, deadline=None)
@given(
    stories=st.lists(st.lists(_KINDS, min_size=1, max_size=25), min_size=1, max_size=3),
    gaps=st.lists(st.sampled_from([0.0, 0.001, 0.05, 0.2]), min_size=1),
    data=st.data(),
)
def test_live_with_budgets_and_rebuilt_agree(
    stories: list[list[str]], gaps: list[float], data: st.DataObject
) -> None:
    """Whatever the order and repetition, once released the live registry is the rebuilt one"""
    stream: list[tuple[ev.Event, float, int]] = []
    stored = T0
    for number, kinds in enumerate(stories):
        drone = FakeDrone(SITE, f"site1-{number:010x}")
        for kind in kinds:
            stored += gaps[len(stream) % len(gaps)]
            if kind == "heartbeat":
                event = drone.heartbeat(interval_s=float(len(stream) + 1))
            elif kind == "started":
                event = drone.payload_started(f"{len(stream)}.0")
            elif kind == "finished":
                event = drone.payload_finished(drone.payloads[0].job_id if drone.payloads else "0")
            else:
                event = drone.drained()
            stream.append((event, stored, len(stream) + 1))
    rebuilt = Registry(NS, budget=SMALL)
    for event, at, seq in sorted(stream, key=lambda item: item[1]):
        _offer(rebuilt, event, at, seq, now=None)

    live = Registry(NS, budget=SMALL)
    order = data.draw(st.permutations(stream), label="order")
    repeats = data.draw(st.lists(st.sampled_from(stream), max_size=10), label="repeats")
    clock = 0.0
    for event, at, seq in [*order, *repeats]:
        clock += 0.01
        _offer(live, event, at, seq, now=clock)
        live.release_held(clock)
    _release_all(live)
    assert dict(live.views()) == dict(rebuilt.views())
    metrics = live.metrics()
    assert metrics.applied + metrics.coalesced + metrics.stale + metrics.duplicate == len(
        order
    ) + len(repeats)


async def test_the_handler_applies_the_held_event_without_a_newer_one() -> None:
    """The consumer's handler: its timer applies the newest event once the budget allows"""
    registry = Registry(NS, budget=SMALL)
    handle = event_handler(registry)
    drone = FakeDrone(SITE, DRONE)
    events = _flips(drone, 8)
    for seq, event in enumerate(events, 1):
        stored_ns = int((T0 + seq / 1000) * 1e9)
        reply = f"$JS.ACK.COBALD_EVENTS.c.1.{seq}.{seq}.{stored_ns}.0"
        handle(event_subject(event), reply, ev.encode(event), {"Nats-Msg-Id": event.id})
    assert registry.accounts.holding((SITE, DRONE)) is not None

    def newest() -> bool:
        view = registry.view(SITE, DRONE)
        return view is not None and view.stream_seq == len(events)

    await wait_until(newest, 10, "the newest event applied")
    assert registry.next_release is None
    metrics = registry.metrics()
    assert (metrics.applied, metrics.coalesced) == (4, 4)


def test_the_waker_counts_state_runs_that_waited_and_their_drones_for_a_minute() -> None:
    now = FakeClock(100.0)
    waker = Waker(lambda drone: True, clock=now)
    for drone in (DRONE, DRONE, OTHER):
        waker.delayed(drone, SMALL)
    assert (waker.counts["state_runs_delayed"], waker.noisy()) == (3, 2)
    now.advance(NOISY_FOR_S / 2)
    waker.delayed(OTHER, SMALL)
    now.advance(NOISY_FOR_S / 2)
    assert waker.noisy() == 1  # only the one delayed again since
