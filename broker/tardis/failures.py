"""
:class:`CallLog`: the log lines of the decorators' failed calls and deferred removals

Its rule: a failure the decorators turn into a safe answer or a TARDIS exception
is logged with its error once per drone, call and cause, then at most once per
interval with a count of the lines held back; a deferred removal is logged once
per drone and reason change. The traceback goes to DEBUG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from remote_agent.protocol.ratelog import RateLimitedLog

#: seconds between two lines of one drone, call and cause
FAILURE_INTERVAL_S: Final = 300.0
#: drones whose last deferral reason is remembered at most (the oldest is forgotten)
_MAX_DEFERRED: Final = 100_000

#: what TARDIS does next when each site call raises (tardis/resources/dronestates.py)
NEXT: Final = {
    "deploy_resource": "TARDIS gives the drone up",  # RequestState → DownState (:90-96)
    "resource_status": "TARDIS asks again next heartbeat",  # StopProcessing(current) (:72-74)
    "stop_resource": "TARDIS tries again next heartbeat",  # ShutDownState (:258-265)
    "terminate_resource": "TARDIS tries again next heartbeat",  # CleanupState (:320-324)
}


class CallLog:
    """
    Rate-limited lines of failed calls, and one line per reason change of a deferred removal

    :param logger: where the lines go
    :param interval_s: minimum seconds between two lines of one drone, call and cause
    :param clock: monotonic seconds (tests pass their own)
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = FAILURE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._failures = RateLimitedLog(logger, interval_s, clock)
        #: drone -> the reason its removal was last deferred for
        self._deferred: dict[str, str] = {}

    def failed(self, call: str, drone: str, err: BaseException, then: str = "") -> bool:
        """
        Log that ``call`` for ``drone`` failed with ``err``; ``True`` if a line was written

        :param then: what happens next (default: what TARDIS does, :data:`NEXT`)
        """
        cause = type(err).__name__
        logged = self._failures.log(
            logging.WARNING,
            f"{call}|{drone}|{cause}",
            "%s of %s failed: %s: %s; %s",
            call,
            drone or "a drone",
            cause,
            err,
            then or NEXT.get(call, "TARDIS goes on"),
            extra={"drone": drone, "call": call, "cause": cause},
            stacklevel=3,
        )
        if logged and self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("%s of %s failed", call, drone, exc_info=err)
        return logged

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
