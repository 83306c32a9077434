"""
:class:`Schedule`: keys due at a time, for the registry's end and retirement checks and the
events it holds back

Its rule: a key is held once, at the earliest time asked for.
"""

from __future__ import annotations

import heapq


class Schedule:
    """
    Keys due at a time, each held once, at the earliest time asked for: however often a
    drone's end or silence moves, it costs one entry (an entry superseded by an earlier
    time is skipped when it falls due)
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, tuple[str, str]]] = []
        self._at: dict[tuple[str, str], float] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, key: tuple[str, str], at: float) -> None:
        known = self._at.get(key)
        if known is None or at < known:
            self._at[key] = at
            heapq.heappush(self._heap, (at, key))

    def pop_due(self, now: float) -> tuple[str, str] | None:
        """The next key due at ``now`` (no longer held), or ``None``"""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, key = heapq.heappop(heap)
            if self._at.get(key) == at:
                del self._at[key]
                return key
        return None

    def next_at(self) -> float | None:
        """When the next key falls due (``None``: none is held)"""
        heap = self._heap
        while heap and self._at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # superseded by an earlier time, or discarded
        return heap[0][0] if heap else None

    def discard(self, key: tuple[str, str]) -> None:
        self._at.pop(key, None)
