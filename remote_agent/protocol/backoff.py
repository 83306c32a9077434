"""Retry delays: doubling from a first delay to a cap, with a little jitter"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """
    The delays before each retry: ``first``, then ``factor`` times the last, at most ``most``

    Each delay is shortened by up to ``jitter`` of itself at random, so that
    clients that failed together do not retry together; a delay is never
    longer than the undisturbed one. :meth:`reset` after a success.
    """

    first: float
    most: float
    factor: float = 2.0
    jitter: float = 0.1
    _next: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.most or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"not a backoff: {self!r}")
        self._next = self.first

    def delay(self) -> float:
        """The delay before the next retry"""
        delay = self._next
        self._next = min(delay * self.factor, self.most)
        return delay * (1.0 - self.jitter * random.random())

    def reset(self) -> None:
        """Start again from ``first``"""
        self._next = self.first
