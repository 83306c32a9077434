"""The one retry-delay rule"""

from __future__ import annotations

import pytest

from remote_agent.protocol.transient import Backoff


def test_delays_double_to_the_cap_never_longer_and_start_again_on_reset() -> None:
    backoff = Backoff(first=0.1, most=0.5)
    delays = [backoff.delay() for _ in range(6)]
    for delay, bound in zip(delays, [0.1, 0.2, 0.4, 0.5, 0.5, 0.5], strict=True):
        assert bound * 0.9 <= delay <= bound
    backoff.reset()
    assert 0.09 <= backoff.delay() <= 0.1


def test_jitter_spreads_clients_that_failed_together() -> None:
    delays = {Backoff(first=1.0, most=1.0).delay() for _ in range(50)}
    assert len(delays) > 1


@pytest.mark.parametrize(
    "args", [(0.0, 1.0, 2.0, 0.1), (2.0, 1.0, 2.0, 0.1), (0.1, 1.0, 0.5, 0.1), (0.1, 1.0, 2.0, 1.0)]
)
def test_nonsense_is_refused(args: tuple[float, float, float, float]) -> None:
    first, most, factor, jitter = args
    with pytest.raises(ValueError, match="not a backoff"):
        Backoff(first=first, most=most, factor=factor, jitter=jitter)
