"""Rate-limited logging: the first line at once, then one per interval with a count"""

import logging

import pytest
from support.clock import FakeClock

from remote_agent.protocol.ratelog import RateLimitedLog


def test_repeated_lines_are_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(100.0)
    log = RateLimitedLog(logging.getLogger("test.ratelog"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        assert log.warning("malformed", "rejected %s", "a")
        for _ in range(500):
            assert not log.warning("malformed", "rejected %s", "b")
        assert log.warning("sender", "rejected %s", "c")  # another kind is not held back
        clock.now += 10.0
        assert log.warning("malformed", "rejected %s", "d")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "rejected a",
        "rejected c",
        "rejected d (and 500 more like it in the last 10s)",
    ]


def test_kinds_are_bounded() -> None:
    log = RateLimitedLog(logging.getLogger("test.ratelog"), clock=FakeClock(100.0))
    for number in range(5000):
        kind = str(number)
        log.log(logging.WARNING, kind, "line")
    assert log.kinds <= 1024
