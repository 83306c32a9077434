"""The issuer's per-site lines: bounded, dropping what does not fit, served in turn"""

from __future__ import annotations

import asyncio
import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.manager.sitequeues import SiteQueues


def test_a_full_line_refuses_and_keeps_nothing_of_what_it_refused() -> None:
    queues: SiteQueues[int] = SiteQueues(capacity=3)
    assert [queues.offer("a", n) for n in range(5)] == [True, True, True, False, False]
    assert queues.waiting("a") == 3
    assert len(queues) == 3
    assert [queues.take_nowait() for _ in range(4)] == [("a", 0), ("a", 1), ("a", 2), None]
    assert queues.offer("a", 5)  # room again


def test_a_full_line_delays_another_site_by_one_item() -> None:
    queues: SiteQueues[str] = SiteQueues(capacity=100)
    for n in range(100):
        assert queues.offer("flood", f"f{n}")
    assert not queues.offer("flood", "f100")
    assert queues.offer("b", "b0")
    assert queues.offer("c", "c0")
    taken = [queues.take_nowait() for _ in range(4)]
    assert taken == [("flood", "f0"), ("b", "b0"), ("c", "c0"), ("flood", "f1")]


def test_sites_with_items_waiting_are_bounded() -> None:
    queues: SiteQueues[int] = SiteQueues(capacity=2, max_sites=2)
    assert queues.offer("a", 1) and queues.offer("b", 1)
    assert not queues.offer("c", 1)
    assert queues.take_nowait() == ("a", 1)  # a's line is empty and gone
    assert queues.offer("c", 1)


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        SiteQueues(capacity=0)


async def test_a_taker_waits_for_an_item_and_a_cancelled_one_passes_its_item_on() -> None:
    queues: SiteQueues[int] = SiteQueues(capacity=4)
    first = asyncio.create_task(queues.take())
    second = asyncio.create_task(queues.take())
    await asyncio.sleep(0)  # both wait
    assert not first.done() and not second.done()
    queues.offer("a", 1)  # wakes the first taker ...
    first.cancel()  # ... which is cancelled before it runs
    assert await second == ("a", 1)
    with pytest.raises(asyncio.CancelledError):
        await first


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("offer"), st.sampled_from("abcd")),
            st.tuples(st.just("take"), st.none()),
        ),
        max_size=300,
    )
)
def test_any_sequence_keeps_each_site_in_order_within_bounds_and_in_turn(
    steps: list[tuple[str, str | None]],
) -> None:
    capacity = 5
    queues: SiteQueues[int] = SiteQueues(capacity=capacity)
    model: dict[str, collections.deque[int]] = collections.defaultdict(collections.deque)
    #: takes since each site was last served while it had something waiting
    passed_over: dict[str, int] = collections.Counter()
    for number, (step, site) in enumerate(steps):
        if step == "offer":
            assert site is not None
            accepted = queues.offer(site, number)
            assert accepted == (len(model[site]) < capacity)
            if accepted:
                model[site].append(number)
        else:
            taken = queues.take_nowait()
            waiting = [name for name, line in model.items() if line]
            if not waiting:
                assert taken is None
                continue
            assert taken is not None
            served, item = taken
            assert item == model[served].popleft()  # each site's items in order
            for name in waiting:
                passed_over[name] = 0 if name == served else passed_over[name] + 1
                # in turn: every site with items waiting is served within one round
                assert passed_over[name] < len(model), (name, passed_over)
        assert len(queues) == sum(len(line) for line in model.values())
