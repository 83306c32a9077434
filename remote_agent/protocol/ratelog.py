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
#: default kinds remembered at most; the oldest is forgotten first (keys are reasons, not senders)
MAX_KINDS: Final = 1024


class RateLimitedLog:
    """
    At most one log line per ``kind`` and ``interval_s``; the next one says how many were held back

    :param logger: where the lines go
    :param interval_s: minimum seconds between two lines of one kind
    :param clock: monotonic seconds (tests pass their own)
    :param max_kinds: kinds remembered at most; a forgotten kind's next line is written at once
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = MAX_KINDS,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._max_kinds = max_kinds
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
        since = self.due(kind)
        if since is None:
            return False
        message, args = with_held(message, args, since)
        self.logger.log(level, message, *args, extra=extra, stacklevel=stacklevel)
        return True

    def due(self, kind: str) -> tuple[int, float] | None:
        """
        Whether a line of ``kind`` is due now, for a caller that writes it itself

        :returns: ``None`` if it is held back (and counted), else the lines held
            back since the kind's last line and the seconds since it (0 for a new kind)
        """
        now = self._clock()
        last = self._kinds.get(kind)
        if last is not None and now - last[0] < self.interval_s:
            self._kinds[kind] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._kinds) >= self._max_kinds:
            del self._kinds[next(iter(self._kinds))]
        self._kinds.pop(kind, None)  # re-insert: the dict stays ordered by last line
        self._kinds[kind] = (now, 0)
        return (0, 0.0) if last is None else (last[1], now - last[0])

    def warning(
        self, kind: str, message: str, *args: object, extra: Mapping[str, Any] | None = None
    ) -> bool:
        return self.log(logging.WARNING, kind, message, *args, extra=extra, stacklevel=3)


def with_held(
    message: str, args: tuple[object, ...], since: tuple[int, float]
) -> tuple[str, tuple[object, ...]]:
    """``message`` and ``args`` saying how many lines were held back (``since``, from ``due``)"""
    held, seconds = since
    if not held:
        return message, args
    return message + " (and %d more like it in the last %.0fs)", (*args, held, seconds)
