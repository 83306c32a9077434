"""Rate-limited logging: the first line at once, then one per interval with a count"""

import logging

import pytest

from remote_agent.protocol.ratelog import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_repeated_lines_are_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
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
    log = RateLimitedLog(logging.getLogger("test.ratelog"), clock=Clock())
    for number in range(5000):
        kind = str(number)
        log.log(logging.WARNING, kind, "line")
    assert log.kinds <= 1024
