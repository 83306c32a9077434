"""
Rate-limited logging of repeated rejections

Hostile or broken input arrives in floods: one drone can send thousands of bad
messages a second. Each rejection is counted where it happens; its log line
goes through :class:`RateLimitedLog`, which writes the first line of each kind
at once and then at most one line per interval, saying how many were held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

#: default seconds between two log lines of the same kind
DEFAULT_INTERVAL_S: Final = 10.0
#: kinds remembered at most; the oldest is forgotten first (keys are reasons, not senders)
_MAX_KINDS: Final = 1024


class RateLimitedLog:
    """
    At most one log line per ``kind`` and ``interval_s``; the next one says how many were held back

    :param logger: where the lines go
    :param interval_s: minimum seconds between two lines of one kind
    :param clock: monotonic seconds (tests pass their own)
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        #: kind -> (time of its last line, lines held back since)
        self._kinds: dict[str, tuple[float, int]] = {}

    @property
    def kinds(self) -> int:
        """How many kinds of line it keeps track of (at most a fixed number)"""
        return len(self._kinds)

    def log(
        self,
        level: int,
        kind: str,
        message: str,
        *args: object,
        extra: Mapping[str, Any] | None = None,
        stacklevel: int = 2,
    ) -> bool:
        """
        Log ``message % args`` unless ``kind`` was logged recently; ``True`` if it was logged

        :param stacklevel: as for :meth:`logging.Logger.log`; the default names the caller
        """
        if not self.logger.isEnabledFor(level):
            return False  # nothing would be written: keep no account of it either
        now = self._clock()
        last = self._kinds.get(kind)
        if last is not None and now - last[0] < self.interval_s:
            self._kinds[kind] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        if last is None and len(self._kinds) >= _MAX_KINDS:
            del self._kinds[next(iter(self._kinds))]
        self._kinds.pop(kind, None)  # re-insert: the dict stays ordered by last line
        self._kinds[kind] = (now, 0)
        if held:
            message += " (and %d more like it in the last %.0fs)"
            args = (*args, held, now - last[0])  # type: ignore[index]
        self.logger.log(level, message, *args, extra=extra, stacklevel=stacklevel)
        return True

    def warning(
        self, kind: str, message: str, *args: object, extra: Mapping[str, Any] | None = None
    ) -> bool:
        return self.log(logging.WARNING, kind, message, *args, extra=extra, stacklevel=3)
