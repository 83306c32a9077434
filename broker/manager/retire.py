"""
Retirement of ended drones, and of drones nothing came of for ``retain_lost_s``: dropped
from the registry, their records purged from the bucket

Its rule: only a drone that is still ended or still silent, with the very view the
registry offered, loses its record, by a subject-filtered purge of the bucket's stream (no
marker: watchers see nothing). Events stay in the event stream until its age limit, for
``timeline``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from broker.manager.grants import GrantStore
from broker.manager.registry import Registry
from broker.manager.views import DroneView
from remote_agent.protocol.ratelog import RateLimitedLog
from remote_agent.protocol.transient import is_transient

log = logging.getLogger("cobald.runtime.cobald_remote.registry")
_failures = RateLimitedLog(log)

#: seconds before a purge that failed for a passing reason is tried again
RETRY_PURGE_S: Final = 60.0
#: drones retired at most per call, so one call never holds the loop long
RETIRE_BATCH: Final = 1000


@dataclass(frozen=True, slots=True)
class Retired:
    """What one :func:`retire_ended` call did"""

    retired: int = 0  #: drones dropped from the registry
    purged: int = 0  #: records purged from the bucket
    kept: int = 0  #: records the server refused to purge (the bucket denies purges)
    retried: int = 0  #: purges that failed for now; tried again later
    lost: int = 0  #: of the retired, drones that had not ended (silent for ``retain_lost_s``)


async def retire_ended(
    js: JetStreamContext,
    registry: Registry,
    now: float,
    *,
    limit: int = RETIRE_BATCH,
    grants: GrantStore | None = None,
) -> Retired:
    """
    Retire up to ``limit`` drones that ended ``retain_ended_s`` before ``now``, or that
    nothing came of for ``retain_lost_s`` (:meth:`Registry.due_retirements`)

    A record the server refuses to purge (a bucket provisioned with ``deny_purge``,
    which the server never lifts) stays, and the drone is dropped from memory all the
    same: a rebuild finds it ended again and retires it again. A purge that fails for
    a passing reason (a timeout, no connection) keeps the drone for a later call.

    :param grants: the issuer's grants: a retired drone's grant goes first, so that
        no drone the registry forgot can renew its identity
    """
    ns = registry.namespace
    retired = purged = kept = retried = lost = 0
    for view in registry.due_retirements(now, limit):
        if grants is not None:
            if not registry.retirable(view):
                continue
            try:
                await grants.purge(view.site, view.drone)
            except (nats.errors.Error, TimeoutError) as err:  # APIError included
                retried += 1
                _retry_later(registry, view, now, "bootstrap grant", err)
                continue
        if view.record is not None:
            if not registry.retirable(view):
                continue  # it changed while an earlier purge was awaited
            try:
                await js.purge_stream(
                    ns.record_stream, subject=ns.record_subject(view.site, view.drone)
                )
                purged += 1
            except nats.js.errors.APIError as err:
                if is_transient(err):  # a bucket between leaders
                    retried += 1
                    _retry_later(registry, view, now, "record", err)
                    continue
                kept += 1
                _failures.warning(
                    "purge refused",
                    "cannot purge the record of retired drone %s/%s: %s; "
                    'it stays in the bucket (docs: operations, "Retention")',
                    view.site,
                    view.drone,
                    err.description,
                    extra={"site": view.site, "drone": view.drone},
                )
            except (nats.errors.Error, TimeoutError) as err:
                retried += 1
                _retry_later(registry, view, now, "record", err)
                continue
        if registry.retire(view):
            retired += 1
            lost += not view.ended
    return Retired(retired, purged, kept, retried, lost)


def _retry_later(
    registry: Registry, view: DroneView, now: float, what: str, err: BaseException
) -> None:
    """A purge failed for a passing reason: the drone stays for a later call"""
    registry.retry_retirement(view, now + RETRY_PURGE_S)
    _failures.warning(
        f"{what} purge failed",
        "cannot purge the %s of retired drone %s/%s yet: %r",
        what,
        view.site,
        view.drone,
        err,
        extra={"site": view.site, "drone": view.drone},
    )
