"""
:class:`CallLog`: the log lines of the decorators' failed calls and deferred removals

Its rule: a failure the decorators turn into a safe answer or a TARDIS exception
is logged with its error once per drone, call and cause, then at most once per
interval with a count of the lines held back; of one call and cause, at most
:data:`DRONE_LINES` drones get such a line per interval, and the others are summed
up in one line with their count, so an outage of a whole fleet writes a bounded
number of lines. A deferred removal is logged once per drone and reason change.
The traceback goes to DEBUG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from remote_agent.protocol.ratelog import MAX_KINDS, RateLimitedLog, with_held

#: seconds between two lines of one drone, call and cause
FAILURE_INTERVAL_S: Final = 300.0
#: drones with a line of their own per call, cause and interval
DRONE_LINES: Final = 10
#: failures (drone, call and cause) remembered at most: the largest fleet a manager serves
#: (bench/scale.py); a forgotten one is logged as new, within the same bound of lines
MAX_FAILING: Final = 100_000
#: drones whose last deferral reason is remembered at most (the oldest is forgotten)
_MAX_DEFERRED: Final = 100_000

#: what TARDIS does next when each site call raises (tardis/resources/dronestates.py)
NEXT: Final = {
    "deploy_resource": "TARDIS gives the drone up",  # RequestState → DownState (:90-96)
    "resource_status": "TARDIS asks again next heartbeat",  # StopProcessing(current) (:72-74)
    "stop_resource": "TARDIS tries again next heartbeat",  # ShutDownState (:258-265)
    "terminate_resource": "TARDIS tries again next heartbeat",  # CleanupState (:320-324)
}


@dataclass(slots=True)
class _Window:
    """One call and cause's lines in one interval, and the drones held back from them"""

    call: str
    cause: str
    then: str
    start: float
    lines: int = 0  #: lines of drones of their own
    drones: int = 0  #: drones due a line but held back
    failures: int = 0  #: their failures
    last: str = ""  #: the last of them and its error


class CallLog:
    """
    Rate-limited lines of failed calls, and one line per reason change of a deferred removal

    :param logger: where the lines go
    :param interval_s: minimum seconds between two lines of one drone, call and cause
    :param clock: monotonic seconds (tests pass their own)
    :param drone_lines: drones with a line of their own per call, cause and interval
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = FAILURE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        drone_lines: int = DRONE_LINES,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.drone_lines = drone_lines
        self._clock = clock
        self._failures = RateLimitedLog(logger, interval_s, clock, max_kinds=MAX_FAILING)
        #: "call|cause" -> its current interval (at most MAX_KINDS, the oldest summed up first)
        self._windows: dict[str, _Window] = {}
        #: drone -> the reason its removal was last deferred for
        self._deferred: dict[str, str] = {}

    def failed(self, call: str, drone: str, err: BaseException, then: str = "") -> bool:
        """
        Log that ``call`` for ``drone`` failed with ``err``; ``True`` if a line was written

        :param then: what happens next (default: what TARDIS does, :data:`NEXT`)
        """
        if not self.logger.isEnabledFor(logging.WARNING):
            return False
        cause = type(err).__name__
        since = self._failures.due(f"{call}|{drone}|{cause}")
        if since is None:
            return False
        window = self._window(call, cause, then or NEXT.get(call, "TARDIS goes on"))
        if window.lines >= self.drone_lines:
            window.drones += 1
            window.failures += since[0] + 1  # the lines held back, and this one
            window.last = f"{drone or 'a drone'}: {err}"
            return False
        window.lines += 1
        message, args = with_held(
            "%s of %s failed: %s: %s; %s",
            (call, drone or "a drone", cause, err, window.then),
            since,
        )
        extra = {"drone": drone, "call": call, "cause": cause}
        self.logger.warning(message, *args, extra=extra, stacklevel=2)
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("%s of %s failed", call, drone, exc_info=err)
        return True

    def _window(self, call: str, cause: str, then: str) -> _Window:
        """The current interval of ``call`` and ``cause``; a past one is summed up first"""
        key = f"{call}|{cause}"
        now = self._clock()
        window = self._windows.pop(key, None)
        if window is not None and now - window.start >= self.interval_s:
            self._sum_up(window, now)
            window = None
        if window is None:
            if len(self._windows) >= MAX_KINDS:
                self._sum_up(self._windows.pop(next(iter(self._windows))), now)
            window = _Window(call, cause, then, now)
        self._windows[key] = window  # re-insert: the dict stays ordered by last use
        return window

    def _sum_up(self, window: _Window, now: float) -> None:
        """The line of the drones ``window`` held back, if any"""
        if not window.drones:
            return
        self.logger.warning(
            "%s failed for %d more drones in the last %.0fs (%d failures): %s, the last %s; %s",
            window.call,
            window.drones,
            now - window.start,
            window.failures,
            window.cause,
            window.last,
            window.then,
            extra={"call": window.call, "cause": window.cause, "drones": window.drones},
            stacklevel=4,
        )

    def deferred(self, action: str, site: str, drone: str, reason: str, detail: str) -> bool:
        """Log a deferred removal if its reason changed; ``True`` if a line was written"""
        return self.once(
            drone,
            reason,
            logging.INFO,
            "%s of %s/%s deferred: %s",
            action,
            site,
            drone,
            detail,
            extra={"drone": drone, "site": site, "reason": reason},
        )

    def once(
        self,
        drone: str,
        reason: str,
        level: int,
        message: str,
        *args: object,
        extra: dict[str, str] | None = None,
    ) -> bool:
        """Log ``message % args`` unless the drone's last line of this kind had ``reason``"""
        if self._deferred.get(drone) == reason:
            return False
        self._deferred.pop(drone, None)
        if len(self._deferred) >= _MAX_DEFERRED:
            del self._deferred[next(iter(self._deferred))]
        self._deferred[drone] = reason
        self.logger.log(level, message, *args, extra=extra, stacklevel=3)
        return True

    def settled(self, drone: str) -> None:
        """The drone's removal went ahead: a later line about it is news again"""
        self._deferred.pop(drone, None)
