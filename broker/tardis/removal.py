"""
:class:`RemovalPolicy`: what ``stop_resource`` and ``terminate_resource`` do, given the verdict

The wrapped adapter removes a drone only when
:meth:`~broker.manager.control.Control.may_remove` says yes; otherwise the
policy releases or drains the drone and raises
``TardisResourceStatusUpdateFailed``, so that TARDIS tries again next heartbeat.
:class:`~broker.tardis.site.RemoteSiteAdapter` asks it before TARDIS calls a
removal, so that a deliberately pending removal does not show as a failed one.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping

from tardis.exceptions.tardisexceptions import TardisResourceStatusUpdateFailed
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.utilities.attributedict import AttributeDict

from broker.manager.blackholes import cleanup_note
from broker.manager.control import Control
from broker.manager.verdict import Removal, Verdict
from broker.tardis.bus import RemoteBus

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")


class RemovalPolicy:
    """
    Removes a site's drones through the wrapped adapter only when the registry's verdict allows

    :param inner: the wrapped site adapter, which removes the batch job
    :param site: the site token of the drones
    :param counts: the site adapter's counters, which the policy adds to
    """

    def __init__(
        self,
        inner: SiteAdapter,
        bus: RemoteBus,
        site: str,
        counts: collections.Counter[str],
    ) -> None:
        self._inner = inner
        self._bus = bus
        self._site = site
        self.counts = counts

    async def lbs_running(self, resource_attributes: AttributeDict) -> bool | None:
        """
        Whether the local batch system runs the drone's job, by the wrapped adapter

        Booting (queued) and Stopped (suspended) count as running: the job may
        start at any moment, or still holds its payloads. ``None``: unknown.
        """
        try:
            response = await self._inner.resource_status(resource_attributes)
        except Exception as err:
            self._bus.call_log.failed(
                "resource_status",
                resource_attributes.drone_uuid,
                err,
                then="whether its batch job runs counts as unknown",
            )
            return None
        status = response.get("resource_status") if isinstance(response, Mapping) else None
        if not isinstance(status, ResourceStatus):
            return None
        return status not in (ResourceStatus.Deleted, ResourceStatus.Error)

    async def verdict(self, resource_attributes: AttributeDict, action: str) -> Verdict | None:
        """
        The verdict on ``action`` for the drone, after releasing or draining it if needed

        ``None`` while the manager is not connected to the bus.
        """
        site, drone = self._site, resource_attributes.drone_uuid
        control = self._bus.control
        if control is None:
            return None
        lbs = await self.lbs_running(resource_attributes)
        verdict = control.may_remove(site, drone, lbs)
        if not verdict:
            verdict = await self._make_removable(control, site, drone, verdict, lbs, action)
        return verdict

    async def check(self, resource_attributes: AttributeDict, action: str) -> Verdict:
        """
        The allowing verdict on ``action``, or ``TardisResourceStatusUpdateFailed`` saying why not

        A deferral is logged once per drone and reason change (:class:`CallLog`).
        """
        verdict = await self.verdict(resource_attributes, action)
        if verdict:
            return verdict
        detail = self._deferred(resource_attributes.drone_uuid, verdict, action)
        raise TardisResourceStatusUpdateFailed(
            f"{action} of {resource_attributes.drone_uuid} deferred: {detail}"
        )

    async def remove(self, resource_attributes: AttributeDict, action: str) -> None:
        """
        ``action`` (``stop_resource`` or ``terminate_resource``) if the verdict allows

        A deferred ``terminate_resource`` returns: TARDIS's CleanupState stays
        CleanupState and calls it again next heartbeat whether it returns or raises
        (dronestates.py:305-326), and warns only when it raises.
        """
        site, drone = self._site, resource_attributes.drone_uuid
        if action == "terminate_resource":
            verdict = await self.verdict(resource_attributes, action)
            if not verdict:
                self._deferred(drone, verdict, action)
                return
        else:
            verdict = await self.check(resource_attributes, action)
        self.counts[f"{action}_allowed"] += 1
        extra = {"drone": drone, "site": site, "reason": str(verdict.reason)}
        log.info("%s of %s/%s: %s", action, site, drone, verdict.detail, extra=extra)
        self._bus.call_log.settled(drone)
        await getattr(self._inner, action)(resource_attributes)

    def _deferred(self, drone: str, verdict: Verdict | None, action: str) -> str:
        """Count and log (once per reason) a deferral; its detail"""
        reason, detail = (
            ("not_connected", "not connected to the bus")
            if verdict is None
            else (str(verdict.reason), verdict.detail)
        )
        self.counts[f"{action}_deferred"] += 1
        self._bus.call_log.deferred(action, self._site, drone, reason, detail)
        return detail

    async def _make_removable(
        self,
        control: Control,
        site: str,
        drone: str,
        verdict: Verdict,
        lbs: bool | None,
        action: str,
    ) -> Verdict:
        """Release or drain the drone so that it may be removed; the verdict after it"""
        reason = verdict.reason
        # the pool's reason if it released the drone; else TARDIS removes it on its own
        why = self._bus.release_reasons.get(drone) or cleanup_note(action.removesuffix("_resource"))
        if reason in (Removal.UNKNOWN_DRONE, Removal.NOT_ANNOUNCED):
            # win the race with the agent, or learn that it came up first and drain
            result = await control.release(
                site, drone, note=why, deadline=self._bus.drain_deadline(), reason=why
            )
            self.counts[f"release_{result.outcome}"] += 1
            return control.may_remove(site, drone, lbs)
        if reason in (Removal.AGENT_UP, Removal.RECORD_TAMPERED, Removal.UNPROVEN_RELEASE):
            # a tampered or unproven record cannot be drained through the record: the
            # drain command alone tells the agent, which drains itself on seeing it anyway
            drained = await control.drain(site, drone, self._bus.drain_deadline(), why)
            self.counts[f"drain_{drained.outcome}"] += 1
            return control.may_remove(site, drone, lbs)
        if reason in (Removal.LOST_BUT_RUNNING, Removal.LOST_LBS_UNKNOWN):
            view = self._bus.registry.view(site, drone)
            deadline = self._bus.lost_deadline(view)
            now = time.time()
            if now >= deadline:
                self._bus.call_log.once(
                    drone,
                    "removal_deadline_passed",
                    logging.WARNING,
                    "removing lost drone %s/%s: %s, and its removal deadline passed",
                    site,
                    drone,
                    verdict.detail,
                    extra={"drone": drone, "site": site},
                )
                return Verdict(True, reason, f"{verdict.detail}; removal deadline passed")
            if view is not None and view.record is not None and view.record.drain is None:
                # a returning agent then drains instead of starting new payloads
                await control.drain(site, drone, self._bus.drain_deadline(), why)
            remaining = deadline - now
            return Verdict(
                False, reason, f"{verdict.detail}; may be removed in {remaining:.0f}s (deadline)"
            )
        return verdict
