"""
TARDIS adapters for the emulated site and overlay pool (loaded inside the COBalD daemon)

Its rule: like TARDIS's stock HTCondor adapters, they decide from polled, cached views.
Configuration (in the ``tardis:`` section)::

    BatchSystem: {adapter: "broker.emulation.site.tardis_adapters:OverlayBatchSystemAdapter",
                  socket: /run/dir/obs.sock, max_age: 10}     # seconds, not minutes
    Sites: [{name: Demo,
             adapter: "broker.emulation.site.tardis_adapters:LocalBatchSiteAdapter", ...}]
    Demo: {socket: /run/dir/lbs.sock, max_age: 10, MachineTypes: [...], ...}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

from tardis.configuration.configuration import Configuration
from tardis.exceptions.tardisexceptions import (
    TardisAuthError,
    TardisDroneCrashed,
    TardisQuotaExceeded,
    TardisResourceStatusUpdateFailed,
    TardisTimeout,
)
from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.utilities.attributedict import AttributeDict

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.rpc import request

log = logging.getLogger("cobald.runtime.emulation.tardis_adapters")

#: HTCondor JobStatus to TARDIS, as TARDIS's HTCondor site adapter maps it
JOB_STATUS = {
    1: ResourceStatus.Booting,
    2: ResourceStatus.Running,
    3: ResourceStatus.Running,  # removed, processes still ending
    4: ResourceStatus.Deleted,
    5: ResourceStatus.Error,
    6: ResourceStatus.Running,
    7: ResourceStatus.Stopped,
}
#: (State, Activity) of a startd ad to TARDIS, as TARDIS's HTCondor batch adapter maps it
MACHINE_STATUS = {
    ("Unclaimed", "Idle"): MachineStatus.Available,
    ("Drained", "Retiring"): MachineStatus.Draining,
    ("Drained", "Idle"): MachineStatus.Drained,
    ("Owner", "Idle"): MachineStatus.NotAvailable,
}


class _Cached:
    """One listing, fetched again only when older than ``max_age_s``"""

    def __init__(self, socket: str, op: str, key: str, max_age_s: float) -> None:
        self.socket, self.op, self.key, self.max_age_s = socket, op, key, max_age_s
        self.value: dict[str, Any] = {}
        self.taken = -math.inf
        self._lock: asyncio.Lock | None = None

    async def get(self) -> tuple[dict[str, Any], float]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if time.time() - self.taken >= self.max_age_s:
                try:
                    reply = await request(self.socket, {"op": self.op}, timeout_s=10)
                except EmulatorUnavailable as err:
                    log.warning("%s failed, using the cached listing: %s", self.op, err)
                else:
                    self.value, self.taken = dict(reply.get(self.key) or {}), time.time()
        return self.value, self.taken


class LocalBatchSiteAdapter(SiteAdapter):
    """
    Drones as jobs of the emulated local batch system

    Job states come from a queue listing refreshed at most every ``max_age`` seconds (a
    cached ``condor_q``); ``stop_resource`` suspends the job (``condor_suspend``),
    ``terminate_resource`` removes it (``condor_rm``: the drone's whole process tree dies,
    payloads included).
    """

    def __init__(self, machine_type: str, site_name: str) -> None:
        self._machine_type = machine_type
        self._site_name = site_name
        config = self.configuration
        self._socket = str(config.socket)
        self._queue = _Cached(self._socket, "q", "jobs", float(getattr(config, "max_age", 0)))
        self._submitted: dict[str, float] = {}

    async def deploy_resource(self, resource_attributes: AttributeDict) -> AttributeDict:
        environment = self.drone_environment(
            resource_attributes.drone_uuid,
            resource_attributes.obs_machine_meta_data_translation_mapping,
        )
        reply = await request(
            self._socket,
            {
                "op": "submit",
                "drone": resource_attributes.drone_uuid,
                "env": {f"TardisDrone{key}": str(value) for key, value in environment.items()},
            },
        )
        job_id = str(reply["job_id"])
        self._submitted[job_id] = time.time()
        return AttributeDict(remote_resource_uuid=job_id, resource_status=ResourceStatus.Booting)

    async def resource_status(self, resource_attributes: AttributeDict) -> AttributeDict:
        jobs, taken = await self._queue.get()
        job_id = str(resource_attributes.remote_resource_uuid)
        code = jobs.get(job_id)
        if code is None:
            # a listing older than the submission cannot know the job yet
            if self._submitted.get(job_id, math.inf) > taken:
                return AttributeDict(resource_status=ResourceStatus.Booting)
            return AttributeDict(resource_status=ResourceStatus.Deleted)
        return AttributeDict(resource_status=JOB_STATUS.get(int(code), ResourceStatus.Error))

    async def _tool(self, op: str, resource_attributes: AttributeDict) -> None:
        job_id = str(resource_attributes.remote_resource_uuid)
        reply = await request(self._socket, {"op": op, "job_ids": [job_id]})
        if not reply.get("done", {}).get(job_id):
            raise TardisResourceStatusUpdateFailed(f"{op} {job_id}: not in the queue")

    async def stop_resource(self, resource_attributes: AttributeDict) -> None:
        await self._tool("suspend", resource_attributes)

    async def terminate_resource(self, resource_attributes: AttributeDict) -> None:
        await self._tool("rm", resource_attributes)

    @contextlib.contextmanager
    def handle_exceptions(self) -> Iterator[None]:
        try:
            yield
        except (
            TardisAuthError,
            TardisDroneCrashed,
            TardisQuotaExceeded,
            TardisResourceStatusUpdateFailed,
            TardisTimeout,
        ):
            raise
        except Exception as err:
            raise TardisResourceStatusUpdateFailed(str(err)) from err


class OverlayBatchSystemAdapter(BatchSystemAdapter):
    """
    The emulated overlay pool's startd ads, through a cache of ``max_age`` seconds

    A startd missing from it is ``NotAvailable``, and ``drain_machine`` silently does nothing
    for it, as TARDIS's HTCondor adapter does on its ``KeyError``.
    """

    def __init__(self) -> None:
        config = Configuration().BatchSystem
        self._socket = str(config.socket)
        self._status = _Cached(self._socket, "status", "machines", float(config.max_age))

    async def _ad(self, drone_uuid: str) -> dict[str, Any] | None:
        ads, _ = await self._status.get()
        ad = ads.get(drone_uuid)
        return ad if isinstance(ad, dict) else None

    async def integrate_machine(self, drone_uuid: str) -> None:
        return None

    async def disintegrate_machine(self, drone_uuid: str) -> None:
        return None

    async def drain_machine(self, drone_uuid: str) -> None:
        if await self._ad(drone_uuid) is None:
            return  # TARDIS's HTCondor adapter: KeyError, "not available or already drained"
        with contextlib.suppress(EmulatorUnavailable):
            await request(self._socket, {"op": "drain", "drone": drone_uuid, "reason": "TARDIS"})

    async def get_machine_status(self, drone_uuid: str) -> MachineStatus:
        ad = await self._ad(drone_uuid)
        if ad is None:
            return MachineStatus.NotAvailable
        key = (str(ad.get("State")), str(ad.get("Activity")))
        return MACHINE_STATUS.get(key, MachineStatus.NotAvailable)

    async def _busy(self, drone_uuid: str) -> float:
        ad = await self._ad(drone_uuid)
        if ad is None or not ad.get("slots"):
            return 0.0
        return float(ad.get("busy", 0)) / float(ad["slots"])

    async def get_allocation(self, drone_uuid: str) -> float:
        return await self._busy(drone_uuid)

    async def get_utilisation(self, drone_uuid: str) -> float:
        return await self._busy(drone_uuid)

    @property
    def machine_meta_data_translation_mapping(self) -> AttributeDict:
        return AttributeDict(Cores=1, Memory=1, Disk=1)
