"""
:class:`RemoteSiteAdapter`: wraps one TARDIS site adapter, forwarding to it

Status answers come from the registry while the drone's agent is heard from, and
from the drone's final record once its agent has exited; removals go through
:class:`~broker.tardis.removal.RemovalPolicy`. Only the exceptions TARDIS handles
for a call may leave it, and each failure turned into one is logged.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
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

from broker.manager.collector import SITE_PART
from broker.manager.views import DroneView
from broker.tardis.bus import RemoteBus
from broker.tardis.config import site_token
from broker.tardis.removal import RemovalPolicy
from remote_agent.protocol.events import DroneState, RecordPhase
from remote_agent.protocol.states import STARTING_STATES

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")

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

#: agent states in which a drone counts as running at its site: its startd took work or can
#: (its gate opened), or it drains; a drone in STARTING_STATES is answered ``Booting``
#: (docs/tardis.md, "When a drone is supply")
_UP_STATES: Final = frozenset(
    {
        DroneState.IDLE,
        DroneState.BUSY,
        DroneState.DRAINING,
        DroneState.DRAINED,
    }
)

#: agent states in which the agent ends its batch job itself: drained, or released
_ENDING_STATES: Final = frozenset({DroneState.DRAINED, DroneState.RELEASED})

#: the answers on which TARDIS calls ``stop_resource`` next, by its state
#: (tardis/resources/dronestates.py: ShutDownState :256-259 on Running)
_REMOVAL_NEXT: Final[Mapping[tuple[str, ResourceStatus], str]] = {
    ("ShutDownState", ResourceStatus.Running): "stop_resource",
}


def finished(view: DroneView | None, now: float, lost_after_s: float) -> str:
    """
    Why the drone's batch job is over, by its final record and its agent's end; ``""``: unknown

    Final: released with the manager's proof, or drained or deadline expired as
    the agent wrote it; and the agent said it is exiting or fell silent. A drone
    whose agent never came up is not known to be over: its job may be queued.
    """
    if view is None:
        return ""
    if view.ended:
        return view.ended
    record = view.record
    if record is None or view.encoded is None:
        return ""
    if view.state is DroneState.EXITING:
        exited = "its agent exited"
    elif view.is_lost(now, lost_after_s):
        exited = "its agent fell silent"
    else:
        return ""
    phase = record.phase
    if _released(view):
        return f"released, and {exited}"
    if phase in (RecordPhase.DRAINED, RecordPhase.DEADLINE_EXPIRED) and record.writer == "agent":
        return f"{phase}, and {exited}"
    return ""


def _released(view: DroneView) -> bool:
    """Whether the manager released the drone (with its proof): its gate never opens"""
    record = view.record
    return record is not None and record.phase is RecordPhase.RELEASED and record.proven


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
        #: the one-time token of each drone being deployed, until its job is submitted
        self._tokens: dict[str, dict[str, str]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        bus.count_sources[SITE_PART + self._site] = self.counts  # the token, as drones name it
        self._removal = RemovalPolicy(inner, bus, self._site, self.counts)
        if self._extra_env or bus.config.bootstrap_key is not None:
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
        return {**environment, **self._extra_env, **self._tokens.get(drone_uuid, {})}

    def __getattr__(self, name: str) -> Any:
        # anything else an adapter offers (only reached for names not found here)
        if name.startswith("__") or name in ("_inner", "_bus", "_removal"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    # ------------------------------------------------------------ calls

    async def _guarded(self, call: str, drone: str, action: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``action``; let out only what TARDIS handles for ``call``, logging the rest"""
        try:
            return await action()
        except _HANDLED[call]:
            raise
        except Exception as err:
            self.counts[f"{call}_failed"] += 1
            self._bus.call_log.failed(call, drone, err)
            raise TardisResourceStatusUpdateFailed(f"{call}: {type(err).__name__}: {err}") from err

    async def deploy_resource(self, resource_attributes: AttributeDict) -> Any:
        """Deploy through the wrapped adapter, with the drone's one-time token if it gets one"""
        drone = resource_attributes.drone_uuid
        self._bus.sites[drone] = self._site

        async def deploy() -> Any:
            self._tokens[drone] = await self._bus.mint(self._site, drone)
            try:
                return await self._inner.deploy_resource(resource_attributes)
            finally:
                del self._tokens[drone]  # in the job now; kept nowhere else

        return await self._guarded("deploy_resource", drone, deploy)

    async def resource_status(self, resource_attributes: AttributeDict) -> Any:
        """
        The drone's status; a removal TARDIS would call next that must wait raises instead

        TARDIS keeps the drone's state, silently, when this raises
        ``TardisResourceStatusUpdateFailed`` (dronestates.py:72-74), and calls
        neither removal: a pending removal is then no failed ``stop_resource``.
        """
        drone = resource_attributes.drone_uuid
        self._bus.sites[drone] = self._site
        answer = await self._status(resource_attributes)
        status = answer.get("resource_status") if isinstance(answer, Mapping) else None
        tardis_state = self._bus.tardis_states.get(drone, "")
        action = _REMOVAL_NEXT.get((tardis_state, status)) if status is not None else None
        ending = self._ending(drone) if action is not None else None
        if ending is not None:
            # its agent drained or was released and ends its batch job itself (then:
            # Deleted, DownState); a stop now would suspend a job that is about to end
            self.counts[f"stop_deferred_{ending}"] += 1
            raise TardisResourceStatusUpdateFailed(f"{drone} is {ending}: its agent ends its job")
        if action is not None:
            await self._guarded(
                "resource_status", drone, lambda: self._removal.check(resource_attributes, action)
            )
        return answer

    def _ending(self, drone: str) -> DroneState | None:
        """The drone's state if its agent, heard from, ends its job itself (drained, released)"""
        view = self._bus.fresh(self._site, drone)
        if view is None or view.state not in _ENDING_STATES:
            return None
        return view.state

    async def _status(self, resource_attributes: AttributeDict) -> Any:
        drone = resource_attributes.drone_uuid
        now = time.time()
        why = finished(
            self._bus.registry.view(self._site, drone), now, self._bus.config.lost_after_s
        )
        if why:
            # Deleted leads every state to DownState without another site call;
            # Stopped would lead to CleanupState and condor_rm (dronestates.py)
            self.counts["status_from_record"] += 1
            log.debug("%s/%s: its job is over (%s): Deleted", self._site, drone, why)
            return AttributeDict(resource_status=ResourceStatus.Deleted)
        view = self._bus.fresh(self._site, drone, now)
        if view is not None and view.state in STARTING_STATES and not _released(view):
            # its job runs, but its startd cannot take work yet: TARDIS's BootingState
            # waits, and follows COBalD's release (dronestates.py:112), which
            # IntegratingState would not (:144). Released, it never will: the site answers
            self.counts["status_from_agent"] += 1
            return AttributeDict(resource_status=ResourceStatus.Booting)
        if view is not None and view.state in _UP_STATES:
            self.counts["status_from_agent"] += 1
            return AttributeDict(resource_status=ResourceStatus.Running)
        self.counts["status_from_adapter"] += 1
        return await self._guarded(
            "resource_status", drone, lambda: self._inner.resource_status(resource_attributes)
        )

    async def stop_resource(self, resource_attributes: AttributeDict) -> Any:
        return await self._guarded(
            "stop_resource",
            resource_attributes.drone_uuid,
            lambda: self._removal.remove(resource_attributes, "stop_resource"),
        )

    async def terminate_resource(self, resource_attributes: AttributeDict) -> Any:
        return await self._guarded(
            "terminate_resource",
            resource_attributes.drone_uuid,
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
            self.counts["site_call_failed"] += 1
            self._bus.call_log.failed("a site call", "", err)
            raise TardisResourceStatusUpdateFailed(f"{type(err).__name__}: {err}") from err

    async def lbs_running(self, resource_attributes: AttributeDict) -> bool | None:
        """Whether the drone's batch job runs (:meth:`RemovalPolicy.lbs_running`)"""
        return await self._removal.lbs_running(resource_attributes)
