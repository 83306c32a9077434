"""The tests' one fake clock: a callable that reads what the test set"""

from __future__ import annotations


class FakeClock:
    """
    A clock to pass where code takes one (``clock=``, ``monotonic``), moved by the test

    :param now: its first reading, seconds
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
