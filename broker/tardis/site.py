"""
:class:`RemoteSiteAdapter`: wraps one TARDIS site adapter, forwarding to it

Status answers come from the registry while the drone's agent is heard from;
removals go through :class:`~broker.tardis.removal.RemovalPolicy`. Only the
exceptions TARDIS handles for a call may leave it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Final

from tardis.exceptions.tardisexceptions import (
    TardisAuthError,
    TardisDroneCrashed,
    TardisQuotaExceeded,
    TardisResourceStatusUpdateFailed,
    TardisTimeout,
)
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.utilities.attributedict import AttributeDict

from broker.tardis.bus import RemoteBus
from broker.tardis.config import site_token
from broker.tardis.removal import RemovalPolicy
from remote_agent.protocol.events import DroneState

#: the exceptions TARDIS's drone states handle for each site call; anything
#: else that escapes aborts the whole COBalD daemon (docs/tardis.md)
_HANDLED: Final[Mapping[str, tuple[type[Exception], ...]]] = {
    "deploy_resource": (
        TardisAuthError,
        TardisTimeout,
        TardisQuotaExceeded,
        TardisResourceStatusUpdateFailed,
        TardisDroneCrashed,
    ),
    "resource_status": (
        TardisAuthError,
        TardisTimeout,
        TardisResourceStatusUpdateFailed,
        TardisDroneCrashed,
    ),
    "stop_resource": (TardisResourceStatusUpdateFailed,),
    "terminate_resource": (TardisResourceStatusUpdateFailed, TardisDroneCrashed),
}
#: what may leave :meth:`RemoteSiteAdapter.handle_exceptions` at all: what TARDIS
#: handles for any site call
TARDIS_EXCEPTIONS: Final = tuple(dict.fromkeys(exc for excs in _HANDLED.values() for exc in excs))

#: agent states in which a drone counts as running at its site
_UP_STATES: Final = frozenset(
    {
        DroneState.STARTING,
        DroneState.WORKER_UP,
        DroneState.STARTD_READY,
        DroneState.IDLE,
        DroneState.BUSY,
        DroneState.DRAINING,
        DroneState.DRAINED,
    }
)


def _forwarded(name: str, convert: Callable[[Any], Any] = lambda value: value) -> Any:
    """A property that reads ``name`` of the wrapped site adapter"""
    return property(lambda self: convert(getattr(self._inner, name)), doc=f"the wrapped {name}")


class RemoteSiteAdapter(SiteAdapter):
    """
    Wraps one TARDIS site adapter instance (HTCondor, Slurm, ...)

    See the module documentation and ``docs/tardis.md`` for what each call does.
    :attr:`counts` tells how often the registry answered and how often the
    wrapped adapter did, and how removals went.
    """

    def __init__(self, inner: SiteAdapter, bus: RemoteBus) -> None:
        self._inner = inner
        self._bus = bus
        self._site = site_token(inner.site_name)
        self._extra_env = bus.drone_environment(self._site)
        self.counts: collections.Counter[str] = collections.Counter()
        bus.count_sources[f"site:{inner.site_name}"] = self.counts
        self._removal = RemovalPolicy(inner, bus, self._site, self.counts)
        if self._extra_env:
            # the adapters call self.drone_environment(...) on *themselves*:
            # shadow it on the instance (docs/tardis.md, "Drone environment")
            inner.drone_environment = self.drone_environment

    @property
    def inner(self) -> SiteAdapter:
        return self._inner

    @property
    def bus_site(self) -> str:
        return self._site

    # ------------------------------------------------------------ forwarding

    # the site adapter's configuration: SiteAdapter's properties, read from the wrapped one
    site_name = _forwarded("site_name", str)
    machine_type = _forwarded("machine_type", str)
    machine_meta_data = _forwarded("machine_meta_data")
    machine_type_configuration = _forwarded("machine_type_configuration")
    configuration = _forwarded("configuration")
    site_configuration = _forwarded("site_configuration")
    drone_heartbeat_interval = _forwarded("drone_heartbeat_interval", int)
    drone_minimum_lifetime = _forwarded(
        "drone_minimum_lifetime", lambda value: None if value is None else int(value)
    )

    def drone_uuid(self, uuid: str) -> str:
        return str(self._inner.drone_uuid(uuid))

    def drone_environment(
        self, drone_uuid: str, meta_data_translation_mapping: Any
    ) -> dict[str, Any]:
        environment: dict[str, Any] = type(self._inner).drone_environment(
            self._inner, drone_uuid, meta_data_translation_mapping
        )
        return {**environment, **self._extra_env}

    def __getattr__(self, name: str) -> Any:
        # anything else an adapter offers (only reached for names not found here)
        if name.startswith("__") or name in ("_inner", "_bus", "_removal"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    # ------------------------------------------------------------ calls

    async def _guarded(self, call: str, action: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``action``; let out only what TARDIS handles for ``call``"""
        try:
            return await action()
        except _HANDLED[call]:
            raise
        except Exception as err:
            self.counts[f"{call}_failed"] += 1
            raise TardisResourceStatusUpdateFailed(f"{call}: {type(err).__name__}: {err}") from err

    async def deploy_resource(self, resource_attributes: AttributeDict) -> Any:
        self._bus.sites[resource_attributes.drone_uuid] = self._site
        return await self._guarded(
            "deploy_resource", lambda: self._inner.deploy_resource(resource_attributes)
        )

    async def resource_status(self, resource_attributes: AttributeDict) -> Any:
        drone = resource_attributes.drone_uuid
        self._bus.sites[drone] = self._site
        view = self._bus.fresh(self._site, drone)
        if view is not None and view.state in _UP_STATES:
            self.counts["status_from_agent"] += 1
            return AttributeDict(resource_status=ResourceStatus.Running)
        self.counts["status_from_adapter"] += 1
        return await self._guarded(
            "resource_status", lambda: self._inner.resource_status(resource_attributes)
        )

    async def stop_resource(self, resource_attributes: AttributeDict) -> Any:
        return await self._guarded(
            "stop_resource", lambda: self._removal.remove(resource_attributes, "stop_resource")
        )

    async def terminate_resource(self, resource_attributes: AttributeDict) -> Any:
        return await self._guarded(
            "terminate_resource",
            lambda: self._removal.remove(resource_attributes, "terminate_resource"),
        )

    @contextlib.contextmanager
    def handle_exceptions(self) -> Iterator[None]:
        """Replaces the wrapped adapter's: only TARDIS's handled exceptions get out"""
        try:
            yield
        except TARDIS_EXCEPTIONS:
            raise
        except Exception as err:  # e.g. TardisError, which would abort the daemon
            raise TardisResourceStatusUpdateFailed(f"{type(err).__name__}: {err}") from err

    async def lbs_running(self, resource_attributes: AttributeDict) -> bool | None:
        """Whether the drone's batch job runs (:meth:`RemovalPolicy.lbs_running`)"""
        return await self._removal.lbs_running(resource_attributes)
