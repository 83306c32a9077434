"""
Bounded waiting lines, one per site, served in turn

What a site sends waits in its own line of at most ``capacity`` items; an item for a
full line is refused at once, so that its sender pays nothing for it (the caller counts
and drops it). Its rule: takers get the sites in turn, one item each, so a site whose
line is full delays another site's item by at most one item per taker, whatever it sends.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Final, Generic, TypeVar

T = TypeVar("T")

#: sites the issuer serves at most (their connections, lines and request rates)
MAX_SITES: Final = 1024


class SiteQueues(Generic[T]):
    """
    A bounded FIFO per site, taken round-robin over the sites with something waiting

    Not thread-safe: offer and take in one event loop.

    :param capacity: items one site may have waiting
    :param max_sites: sites that may have items waiting at once (memory is bounded by
        ``capacity * max_sites`` items)
    """

    def __init__(self, capacity: int, max_sites: int = MAX_SITES) -> None:
        if capacity < 1 or max_sites < 1:
            raise ValueError("a site queue holds at least one item, of at least one site")
        self.capacity = capacity
        self.max_sites = max_sites
        #: the lines with items waiting (an emptied line is removed)
        self._lines: dict[str, collections.deque[T]] = {}
        #: the sites with items waiting, the next to be served first
        self._turns: collections.deque[str] = collections.deque()
        self._takers: collections.deque[asyncio.Future[None]] = collections.deque()

    def __len__(self) -> int:
        """Items waiting, every site's together"""
        return sum(len(line) for line in self._lines.values())

    def waiting(self, site: str) -> int:
        """Items of ``site`` waiting"""
        line = self._lines.get(site)
        return 0 if line is None else len(line)

    def offer(self, site: str, item: T) -> bool:
        """Add ``item`` to the end of ``site``'s line; ``False`` (and nothing kept) if it is full"""
        line = self._lines.get(site)
        if line is None:
            if len(self._lines) >= self.max_sites:
                return False
            line = self._lines[site] = collections.deque()
            self._turns.append(site)
        elif len(line) >= self.capacity:
            return False
        line.append(item)
        self._wake_next()
        return True

    def take_nowait(self) -> tuple[str, T] | None:
        """The next site's oldest item, or ``None`` if nothing waits"""
        if not self._turns:
            return None
        site = self._turns.popleft()
        line = self._lines[site]
        item = line.popleft()
        if line:
            self._turns.append(site)  # its next item after every other site's
        else:
            del self._lines[site]
        return site, item

    async def take(self) -> tuple[str, T]:
        """The next site's oldest item, once there is one"""
        while True:
            taken = self.take_nowait()
            if taken is not None:
                return taken
            taker = asyncio.get_running_loop().create_future()
            self._takers.append(taker)
            try:
                await taker
            except asyncio.CancelledError:
                if taker.done() and not taker.cancelled() and self._turns:
                    self._wake_next()  # it was woken for an item: pass that on
                raise

    def _wake_next(self) -> None:
        while self._takers:
            taker = self._takers.popleft()
            if not taker.done():
                taker.set_result(None)
                return
