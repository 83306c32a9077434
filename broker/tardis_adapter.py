"""
The TARDIS/COBalD integration: push-fed adapters, self-drain, and a release-aware pool

This is the only module of cobald-remote that imports ``tardis`` and COBalD's
pool classes. It wraps TARDIS's own adapter *instances* (any site adapter,
any batch-system adapter) instead of copying them, and builds TARDIS's
composite pool the way ``tardis.resources.poolfactory`` does:

* :class:`RemoteSiteAdapter` passes the agent's settings into every drone's
  environment, answers ``resource_status`` from the registry while the
  drone's agent is heard from, and lets ``stop_resource`` and
  ``terminate_resource`` reach the wrapped adapter only when
  :meth:`~broker.manager.control.Control.may_remove` says the job may be removed
  (after a release or a self-drain); otherwise it raises
  ``TardisResourceStatusUpdateFailed`` and TARDIS tries again next heartbeat;
* :class:`RemoteBatchSystemAdapter` answers machine status, allocation and
  utilisation from the agents' reports and turns ``drain_machine`` into the
  drone's self-drain;
* :class:`TardisStateNotes` publishes TARDIS's own state transitions per
  drone as manager notes (``<prefix>.<site>.<drone>.mgr.tardis_state``);
* :class:`RemoteFactoryPool` releases drones without payloads before drones
  with payloads;
* :func:`create_composite_pool` wires it all, usable as ``__type__`` or as the
  YAML tag ``!RemoteTardisPoolFactory`` (entry point group
  ``cobald.config.yaml_constructors``).

``docs/tardis.md`` says how to configure it and what each wrapped call does.
COBalD loads this module for *every* YAML configuration (it loads every entry
point of the group), so importing it must stay cheap and free of side effects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import enum
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial
from importlib import import_module
from typing import Any, Final

import nats.errors
from cobald.composite.factory import FactoryPool
from cobald.composite.weighted import WeightedComposite
from cobald.daemon.runners.service import ServiceUnit
from cobald.decorator.logger import Logger
from cobald.decorator.standardiser import Standardiser
from cobald.interfaces._partial import Partial
from cobald.utility.primitives import infinity
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.configuration.configuration import Configuration
from tardis.exceptions.tardisexceptions import (
    TardisAuthError,
    TardisDroneCrashed,
    TardisQuotaExceeded,
    TardisResourceStatusUpdateFailed,
    TardisTimeout,
)
from tardis.interfaces.batchsystemadapter import BatchSystemAdapter, MachineStatus
from tardis.interfaces.plugin import Plugin
from tardis.interfaces.siteadapter import ResourceStatus, SiteAdapter
from tardis.resources.poolfactory import create_drone, get_drones_to_restore, load_plugins
from tardis.utilities.attributedict import AttributeDict

from broker.jetstream.consumer import DEFAULT_DURABLE
from broker.manager.control import (
    DEFAULT_DRAIN_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    Control,
    Removal,
    Verdict,
)
from broker.manager.metrics import MetricsServer, Sources, parse_address
from broker.manager.registry import DEFAULT_LOST_AFTER_S, DroneView, Registry
from broker.manager.service import ManagerService, ManagerSettings
from remote_agent.protocol.environment import TARDIS_SETTINGS_ENV, split_urls
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import DroneState, TardisState, encode, utcnow
from remote_agent.protocol.names import DEFAULT_PREFIX, Namespace, check_token

log = logging.getLogger(__name__)

#: prefix TARDIS's site adapters put before every drone environment key
TARDIS_ENV_PREFIX: Final = "TardisDrone"

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
#: what may leave :meth:`RemoteSiteAdapter.handle_exceptions` at all
TARDIS_EXCEPTIONS: Final = (
    TardisAuthError,
    TardisDroneCrashed,
    TardisQuotaExceeded,
    TardisResourceStatusUpdateFailed,
    TardisTimeout,
)

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
#: the overlay batch system's view of a drone, from its agent's state
_MACHINE_STATUS: Final = {
    DroneState.STARTING: MachineStatus.Available,
    DroneState.WORKER_UP: MachineStatus.Available,
    DroneState.STARTD_READY: MachineStatus.Available,
    DroneState.IDLE: MachineStatus.Available,
    DroneState.BUSY: MachineStatus.Available,
    DroneState.DRAINING: MachineStatus.Draining,
    DroneState.DRAINED: MachineStatus.Drained,
    DroneState.RELEASED: MachineStatus.Drained,
    DroneState.EXITING: MachineStatus.Drained,
}


# ---------------------------------------------------------------------- configuration


def _servers(value: object, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        items = split_urls(value)
    elif isinstance(value, Sequence):
        items = [str(part).strip() for part in value]
    else:
        raise ValueError(f"bus.{key} must be a URL, a comma-separated string or a list")
    urls = tuple(item for item in items if item)
    if not urls:
        raise ValueError(f"bus.{key} names no URL")
    return urls


@dataclass(frozen=True, slots=True)
class BusConfig:
    """
    The ``bus:`` section of the pool factory, parsed once

    :param servers: NATS URLs the manager connects to
    :param drone_servers: NATS URLs given to the drones (default ``servers``;
        differs when drones reach the bus through a site's leaf node)
    :param creds: the manager's NATS credentials file
    :param domain: JetStream domain (leaf-node deployments)
    :param prefix: first subject token, as the agents use it
    :param durable: name of the manager's durable consumer
    :param lost_after_s: a drone whose agent was silent this long is *lost*:
        its facts are stale and the wrapped adapters answer again
    :param drain_deadline_s: deadline of the self-drains TARDIS asks for,
        counted from the request
    :param lost_removal_after_s: a lost drone whose batch job still runs is
        removed only after this much silence (and not before its drain deadline)
    :param request_timeout_s: how long commands wait for an agent's answer
    :param drone_environment: pass ``servers``/site/prefix into each drone job
    :param note_buffer: TARDIS state notes kept while the bus is unreachable
    :param metrics: ``host:port`` to serve Prometheus metrics on (``/metrics``);
        ``None``: no metrics endpoint
    """

    servers: tuple[str, ...]
    drone_servers: tuple[str, ...] = ()
    creds: str | None = None
    domain: str | None = None
    prefix: str = DEFAULT_PREFIX
    durable: str = DEFAULT_DURABLE
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    drain_deadline_s: float = DEFAULT_DRAIN_S
    lost_removal_after_s: float = DEFAULT_DRAIN_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    drone_environment: bool = True
    note_buffer: int = 10_000
    metrics: str | None = None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> BusConfig:
        """
        :raises ValueError: for unknown keys, missing servers or bad values
        """
        if not isinstance(mapping, Mapping):
            raise ValueError("bus must be a mapping with at least 'servers'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"unknown bus settings: {', '.join(unknown)} (known: {sorted(known)})")
        if "servers" not in mapping:
            raise ValueError("bus.servers is required, e.g. nats://nats.example.org:4222")
        values = dict(mapping)
        values["servers"] = _servers(values["servers"], "servers")
        if values.get("drone_servers"):
            values["drone_servers"] = _servers(values["drone_servers"], "drone_servers")
        else:
            values["drone_servers"] = values["servers"]
        for name in (
            "lost_after_s",
            "drain_deadline_s",
            "lost_removal_after_s",
            "request_timeout_s",
        ):
            if name in values:
                number = float(values[name])
                if not (number > 0 and math.isfinite(number)):
                    raise ValueError(f"bus.{name} must be a positive number of seconds")
                values[name] = number
        try:
            check_token(str(values.get("prefix", DEFAULT_PREFIX)), "bus.prefix")
        except SchemaError as err:
            raise ValueError(str(err)) from None
        if values.get("metrics") is not None:
            values["metrics"] = str(values["metrics"])
            parse_address(values["metrics"])  # raises ValueError with the reason
        return cls(**values)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where to serve metrics, ``(host, port)``, or ``None``"""
        return parse_address(self.metrics) if self.metrics is not None else None

    def manager_settings(self) -> ManagerSettings:
        return ManagerSettings(
            servers=self.servers,
            creds=self.creds,
            namespace=Namespace(self.prefix),
            domain=self.domain,
            durable=self.durable,
            lost_after_s=self.lost_after_s,
            request_timeout_s=self.request_timeout_s,
        )


def site_token(site_name: str) -> str:
    """
    The site as drones and subjects name it: TARDIS's site name in lower case

    That is the part of every drone uuid before its last ``-``, so the agent,
    the operator commands and the adapters agree without configuration.

    :raises ValueError: if it cannot be a subject token
    """
    try:
        return check_token(site_name.lower(), f"site name {site_name!r}")
    except SchemaError as err:
        raise ValueError(str(err)) from None


# ---------------------------------------------------------------------- the bus


class RemoteBus:
    """
    The manager service inside COBalD: registry, control and TARDIS's notes

    COBalD runs :meth:`run` in its asyncio loop (the one the drones run in)
    because the instance registers itself as a COBalD service. COBalD keeps
    services only by weak reference: the adapters and the pool built by
    :func:`create_composite_pool` hold the strong ones.

    Reads from COBalD's trio thread (the pool's release order) use
    :attr:`registry` only, whose views are immutable and replaced atomically.

    :param register: register with COBalD's runtime (tests run :meth:`run` themselves)
    """

    def __init__(self, config: BusConfig, *, register: bool = True) -> None:
        self.config = config
        self.namespace = Namespace(config.prefix)
        self.manager = ManagerService(config.manager_settings())
        self.registry: Registry = self.manager.registry
        #: the site of every drone the site adapters saw, by drone uuid
        self.sites: dict[str, str] = {}
        #: TARDIS's latest state of every drone, by drone uuid (class name)
        self.tardis_states: dict[str, str] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        #: every counter of the integration, by part: the bus, each site, the batch system
        self.count_sources: dict[str, collections.Counter[str]] = {"bus": self.counts}
        self._notes: collections.deque[TardisState] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self.metrics: MetricsServer | None = None
        address = config.metrics_address
        if address is not None:
            self.metrics = MetricsServer(
                Sources(
                    registry=self.registry,
                    consumer=self.manager.consumer_stats,
                    connected=self.manager.ready.is_set,
                    failures=lambda: self.manager.failures,
                    rebuild_seconds=lambda: (
                        report.seconds if (report := self.manager.last_rebuild) else None
                    ),
                    tardis_calls=lambda: self.count_sources,
                    notes_buffered=lambda: len(self._notes),
                ),
                *address,
            )
        if register:  # COBalD picks the runner by the flavour, the asyncio module
            self.__service_unit__ = ServiceUnit(self, asyncio)

    # ------------------------------------------------------------ running

    async def run(self) -> None:
        """The manager service and the note publisher; never returns until :meth:`stop`"""
        self._wake = asyncio.Event()
        if self._notes:
            self._wake.set()
        log.info(
            "cobald-remote bus for TARDIS: %s, prefix %s",
            ",".join(self.config.servers),
            self.config.prefix,
        )
        self._stopped = asyncio.Event()
        if self._stopping:
            self._stopped.set()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.manager.run())
            tg.create_task(self._publish_notes())
            if self.metrics is not None:
                tg.create_task(self.metrics.run(self._stopped))

    def stop(self) -> None:
        self._stopping = True
        self.manager.stop()
        if self._wake is not None:
            self._wake.set()
        if self._stopped is not None:
            self._stopped.set()

    @property
    def control(self) -> Control | None:
        """The control API while connected, else ``None``"""
        return self.manager.control if self.manager.ready.is_set() else None

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.manager.ready.wait(), timeout_s)
        return self.manager.ready.is_set()

    # ------------------------------------------------------------ facts

    def site_of(self, drone: str) -> str:
        """The site of ``drone``: as a site adapter saw it, else its uuid before the last ``-``"""
        known = self.sites.get(drone)
        if known is not None:
            return known
        site, dash, _ = drone.rpartition("-")
        return site if dash and site else drone

    def fresh(self, site: str, drone: str, now: float | None = None) -> DroneView | None:
        """
        The drone's view if its agent announced itself and is not lost, else ``None``

        "Fresh" is the rule for answering from the registry instead of the
        wrapped adapters: the agent was heard from within ``lost_after_s``.
        """
        view = self.registry.view(site, drone)
        if view is None or view.encoded is None:  # no event yet (at most a record)
            return None
        if view.is_lost(time.time() if now is None else now, self.config.lost_after_s):
            return None
        return view

    def lost_deadline(self, view: DroneView | None) -> float:
        """
        When a lost drone whose batch job still runs may be removed, epoch seconds

        ``lost_removal_after_s`` after its last sign of life, and not before
        the deadline of a drain it was asked for.
        """
        if view is None or view.last_seen is None:
            return -math.inf
        deadline = view.last_seen + self.config.lost_removal_after_s
        record = view.record
        if record is not None and record.drain is not None:
            deadline = max(deadline, record.drain.deadline.timestamp())
        return deadline

    def drone_environment(self, site: str) -> dict[str, str]:
        """What every drone job of ``site`` gets, keyed as TARDIS adds ``TardisDrone``"""
        if not self.config.drone_environment:
            return {}
        values = {
            "servers": ",".join(self.config.drone_servers),
            "site": site,
            "prefix": self.config.prefix,
        }
        if self.config.domain:  # the drones reach the central stream through a leaf node
            values["domain"] = self.config.domain
        return {
            TARDIS_SETTINGS_ENV[name].removeprefix(TARDIS_ENV_PREFIX): value
            for name, value in values.items()
        }

    def drain_deadline(self) -> dt.datetime:
        return utcnow() + dt.timedelta(seconds=self.config.drain_deadline_s)

    # ------------------------------------------------------------ notes

    def note_state(self, site: str, drone: str, state: str, resource_status: str) -> None:
        """Queue a TARDIS state note for publishing; never blocks, never raises"""
        self.tardis_states[drone] = state
        try:
            note = TardisState(
                site=site,
                drone=drone,
                state=state,
                resource_status=resource_status,
                at=utcnow(),
                id=uuid.uuid4().hex,
            )
        except Exception as err:  # msgspec validates on decode only; keep it defensive
            self.counts["notes_invalid"] += 1
            log.warning("cannot note TARDIS state of %s: %s", drone, err)
            return
        if len(self._notes) >= self.config.note_buffer:
            self._notes.popleft()
            self.counts["notes_dropped"] += 1
        self._notes.append(note)
        if self._wake is not None:
            self._wake.set()

    async def _publish_notes(self) -> None:
        retry_s = 1.0
        while not self._stopping:
            assert self._wake is not None
            if not self._notes:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 5.0)
                continue
            control = self.control
            if control is None:
                await asyncio.sleep(retry_s)
                continue
            note = self._notes[0]
            subject = self.namespace.manager_note(note.site, note.drone, "tardis_state")
            try:
                js = control.nc.jetstream(domain=self.config.domain)
                await js.publish(
                    subject, encode(note), timeout=5.0, headers={"Nats-Msg-Id": note.id}
                )
            except (nats.errors.Error, TimeoutError, OSError) as err:
                self.counts["notes_retried"] += 1
                log.debug("cannot publish a TARDIS note yet: %r", err)
                await asyncio.sleep(retry_s)
                continue
            except Exception:  # a bug must not stop the daemon
                self.counts["notes_dropped"] += 1
                log.exception("dropping TARDIS note for %s", note.drone)
            else:
                self.counts["notes_published"] += 1
            if self._notes and self._notes[0] is note:
                self._notes.popleft()


# ---------------------------------------------------------------------- site side


def _status_name(value: object) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    return "" if value is None else str(value)


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

    @property
    def site_name(self) -> str:
        return str(self._inner.site_name)

    @property
    def machine_type(self) -> str:
        return str(self._inner.machine_type)

    @property
    def machine_meta_data(self) -> Any:
        return self._inner.machine_meta_data

    @property
    def machine_type_configuration(self) -> Any:
        return self._inner.machine_type_configuration

    @property
    def configuration(self) -> Any:
        return self._inner.configuration

    @property
    def site_configuration(self) -> Any:
        return self._inner.site_configuration

    @property
    def drone_heartbeat_interval(self) -> int:
        return int(self._inner.drone_heartbeat_interval)

    @property
    def drone_minimum_lifetime(self) -> int | None:
        value = self._inner.drone_minimum_lifetime
        return None if value is None else int(value)

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
        if name.startswith("__") or name in ("_inner", "_bus"):
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
            "stop_resource", lambda: self._remove(resource_attributes, "stop_resource")
        )

    async def terminate_resource(self, resource_attributes: AttributeDict) -> Any:
        return await self._guarded(
            "terminate_resource", lambda: self._remove(resource_attributes, "terminate_resource")
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

    # ------------------------------------------------------------ removal

    async def lbs_running(self, resource_attributes: AttributeDict) -> bool | None:
        """
        Whether the local batch system runs the drone's job, by the wrapped adapter

        Booting (queued) and Stopped (suspended) count as running: the job may
        start at any moment, or still holds its payloads. ``None``: unknown.
        """
        try:
            response = await self._inner.resource_status(resource_attributes)
        except Exception as err:
            log.info("cannot ask the site about %s: %r", resource_attributes.drone_uuid, err)
            return None
        status = response.get("resource_status") if isinstance(response, Mapping) else None
        if not isinstance(status, ResourceStatus):
            return None
        return status not in (ResourceStatus.Deleted, ResourceStatus.Error)

    async def _remove(self, resource_attributes: AttributeDict, action: str) -> None:
        site, drone = self._site, resource_attributes.drone_uuid
        control = self._bus.control
        if control is None:
            self.counts[f"{action}_deferred"] += 1
            raise TardisResourceStatusUpdateFailed(
                f"{action} of {drone} deferred: not connected to the bus"
            )
        lbs = await self.lbs_running(resource_attributes)
        verdict = control.may_remove(site, drone, lbs)
        if not verdict:
            verdict = await self._make_removable(control, site, drone, verdict, lbs, action)
        if not verdict:
            self.counts[f"{action}_deferred"] += 1
            log.info(
                "%s of %s/%s deferred: %s",
                action,
                site,
                drone,
                verdict.detail,
                extra={"drone": drone, "site": site, "reason": str(verdict.reason)},
            )
            raise TardisResourceStatusUpdateFailed(
                f"{action} of {drone} deferred: {verdict.detail}"
            )
        self.counts[f"{action}_allowed"] += 1
        log.info(
            "%s of %s/%s: %s",
            action,
            site,
            drone,
            verdict.detail,
            extra={"drone": drone, "site": site, "reason": str(verdict.reason)},
        )
        await getattr(self._inner, action)(resource_attributes)

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
        why = f"TARDIS {action.removesuffix('_resource')}"
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
                log.warning(
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


# ---------------------------------------------------------------------- batch side


class RemoteBatchSystemAdapter(BatchSystemAdapter):
    """
    Wraps TARDIS's batch-system adapter instance (the overlay batch system)

    ``BatchSystemAgent`` forwards raw and no drone state catches anything from
    these calls, so nothing may escape: every call returns a safe value.
    """

    def __init__(self, inner: BatchSystemAdapter, bus: RemoteBus) -> None:
        self._inner = inner
        self._bus = bus
        self._last_status: dict[str, MachineStatus] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        bus.count_sources["batch_system"] = self.counts

    @property
    def inner(self) -> BatchSystemAdapter:
        return self._inner

    @property
    def machine_meta_data_translation_mapping(self) -> Any:
        return self._inner.machine_meta_data_translation_mapping

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_inner", "_bus"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    async def _fallback(self, call: str, drone_uuid: str, default: Any) -> Any:
        self.counts[f"{call}_from_adapter"] += 1
        try:
            return await getattr(self._inner, call)(drone_uuid=drone_uuid)
        except Exception as err:
            self.counts[f"{call}_failed"] += 1
            log.warning(
                "batch system %s(%s) failed, answering %r: %r",
                call,
                drone_uuid,
                default,
                err,
                extra={"drone": drone_uuid},
            )
            return default

    def _view(self, drone_uuid: str) -> DroneView | None:
        return self._bus.fresh(self._bus.site_of(drone_uuid), drone_uuid)

    async def integrate_machine(self, drone_uuid: str) -> None:
        await self._fallback("integrate_machine", drone_uuid, None)

    async def disintegrate_machine(self, drone_uuid: str) -> None:
        await self._fallback("disintegrate_machine", drone_uuid, None)

    async def drain_machine(self, drone_uuid: str) -> None:
        """The drone's self-drain; the wrapped adapter's drain when its agent is not heard"""
        try:
            handled = await self._self_drain(drone_uuid)
        except Exception as err:
            self.counts["drain_failed"] += 1
            log.warning("self-drain of %s failed: %r", drone_uuid, err, extra={"drone": drone_uuid})
            handled = False
        if not handled:
            await self._fallback("drain_machine", drone_uuid, None)

    async def _self_drain(self, drone_uuid: str) -> bool:
        control = self._bus.control
        if control is None:
            return False
        site = self._bus.site_of(drone_uuid)
        why = "TARDIS drain"
        deadline = self._bus.drain_deadline()
        view = self._bus.registry.view(site, drone_uuid)
        if view is None or view.encoded is None:
            # never announced: release it (or learn that its agent won, and drain);
            # its startd, if it runs without an agent, is drained in the OBS as well
            released = await control.release(site, drone_uuid, note=why, deadline=deadline)
            self.counts[f"drain_release_{released.outcome}"] += 1
            return False
        drained = await control.drain(site, drone_uuid, deadline, why)
        self.counts[f"drain_{drained.outcome}"] += 1
        # a lost agent may not act on the recorded intent soon: drain in the OBS too
        return self._bus.fresh(site, drone_uuid) is not None

    async def get_machine_status(self, drone_uuid: str) -> MachineStatus:
        view = self._view(drone_uuid)
        if view is not None and view.state is not None:
            self.counts["get_machine_status_from_agent"] += 1
            status = _MACHINE_STATUS[view.state]
        else:
            default = self._last_status.get(drone_uuid, MachineStatus.NotAvailable)
            status = await self._fallback("get_machine_status", drone_uuid, default)
            if not isinstance(status, MachineStatus):
                status = default
        self._last_status[drone_uuid] = status
        return status

    def _busy_fraction(self, view: DroneView) -> float:
        snapshot = view.snapshot
        if snapshot is None or snapshot.slots <= 0:
            return 0.0
        return min(1.0, len(snapshot.payloads) / snapshot.slots)

    async def get_allocation(self, drone_uuid: str) -> float:
        view = self._view(drone_uuid)
        if view is not None:
            self.counts["get_allocation_from_agent"] += 1
            return self._busy_fraction(view)
        return _number(await self._fallback("get_allocation", drone_uuid, 0.0))

    async def get_utilisation(self, drone_uuid: str) -> float:
        view = self._view(drone_uuid)
        if view is not None:
            self.counts["get_utilisation_from_agent"] += 1
            return self._busy_fraction(view)
        return _number(await self._fallback("get_utilisation", drone_uuid, 0.0))


def _number(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


# ---------------------------------------------------------------------- plugin


class TardisStateNotes(Plugin):
    """
    A TARDIS plugin: every state transition of every drone, as a manager note

    TARDIS awaits plugins inside the drone's own task, one after another, and
    an exception there aborts the daemon: :meth:`notify` only queues the note.
    """

    def __init__(self, bus: RemoteBus) -> None:
        self.bus = bus

    async def notify(self, state: Any, resource_attributes: AttributeDict) -> None:
        try:
            drone = str(resource_attributes["drone_uuid"])
            site = self.bus.sites.get(drone) or site_token(str(resource_attributes["site_name"]))
            self.bus.note_state(
                site,
                drone,
                str(state),
                _status_name(resource_attributes.get("resource_status")),
            )
        except Exception:
            log.exception("cannot note a TARDIS state change")


# ---------------------------------------------------------------------- pool


class RemoteFactoryPool(FactoryPool):
    """
    A FactoryPool that releases drones without payloads before drones with payloads

    Release order (ascending :meth:`release_key`): drones whose agent never
    announced itself (nothing can run on them: the release handshake stops
    them cheaply), then drones whose agent reports no payload, then drones
    with payloads, fewest first; ties by COBalD's own ``supply x utilisation``.

    :meth:`_shrink` runs in COBalD's trio thread: the key reads plain
    attributes and the registry's immutable views only.
    """

    def __init__(
        self,
        *children: Any,
        factory: Callable[[], Any],
        interval: float = 30,
        bus: RemoteBus | None = None,
        site: str = "",
    ) -> None:
        super().__init__(*children, factory=factory, interval=interval)
        self.bus = bus
        self.site = site

    def release_key(self, child: Any) -> tuple[int, int, float]:
        base = float(child.supply * child.utilisation)
        try:
            drone = child.resource_attributes["drone_uuid"]
        except (AttributeError, KeyError, TypeError):
            return (1, 0, base)
        bus = self.bus
        view = bus.registry.view(self.site, drone) if bus is not None else None
        snapshot = view.snapshot if view is not None else None
        if snapshot is None:
            return (0, 0, base)
        payloads = len(snapshot.payloads)
        return (2 if payloads else 1, payloads, base)

    def _shrink(self, target: float) -> None:
        # cobald 0.14 FactoryPool._shrink, with our order instead of supply x utilisation
        hit_list = sorted(self._hatchery, key=self.release_key)
        excess_demand = sum(child.demand for child in hit_list) - target
        for child in hit_list:
            if excess_demand <= 0:
                break
            if child.demand <= excess_demand:
                excess_demand -= child.demand
                self._release_child(child)
        self._reap_children()


# ---------------------------------------------------------------------- factory


def load_object(name: str) -> Any:
    """``pkg.mod:Name`` or ``pkg.mod.Name`` as the object it names"""
    module, sep, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not sep or not module or not attr:
        raise ValueError(f"{name!r} is not a dotted name (pkg.module:Name)")
    return getattr(import_module(module), attr)


def load_adapter(kind: str, name: str) -> Any:
    """
    An adapter class: TARDIS's own by name (``HTCondor``) or any by dotted name

    :param kind: ``sites`` or ``batchsystems``
    """
    if ":" in name or "." in name:
        return load_object(name)
    return getattr(import_module(f"tardis.adapters.{kind}.{name.lower()}"), f"{name}Adapter")


def _observers(observers: Mapping[str, Any] | Sequence[str] | None) -> list[Any]:
    if not observers:
        return []
    if isinstance(observers, str):
        observers = [observers]
    items = (
        observers.items()
        if isinstance(observers, Mapping)
        else ((name, None) for name in observers)
    )
    return [load_object(name)(**(kwargs or {})) for name, kwargs in items]


def create_composite_pool(
    configuration: str | dict[str, Any] | None = None,
    interval: float = 30,
    bus: Mapping[str, Any] | None = None,
    observers: Mapping[str, Any] | Sequence[str] | None = None,
) -> Any:
    """
    TARDIS's composite pool, with the bus between TARDIS and its adapters

    Builds what ``tardis.resources.poolfactory.create_composite_pool`` builds
    (reusing its ``create_drone``, ``get_drones_to_restore`` and
    ``load_plugins``), except that

    * each site adapter and the batch-system adapter are wrapped in
      :class:`RemoteSiteAdapter` and :class:`RemoteBatchSystemAdapter`,
      the :class:`TardisStateNotes` plugin is added, and each machine type
      gets a :class:`RemoteFactoryPool`; without ``bus`` nothing is wrapped
      (stock TARDIS behaviour, for comparisons);
    * adapters may be given by dotted name (``pkg.mod:Class``) besides
      TARDIS's own names;
    * the pools adjust every ``interval`` seconds (TARDIS: COBalD's 30 s).

    :param configuration: a TARDIS configuration file or mapping; ``None``
        for the ``tardis:`` section of a unified COBalD configuration
    :param interval: seconds between the pools' adjustments
    :param bus: the ``bus:`` section (:class:`BusConfig`)
    :param observers: more TARDIS plugins, ``{"pkg.mod:Class": {kwargs}}``
        or a list of names (TARDIS itself loads plugins only from ``tardis.plugins``)
    :raises ValueError: for an invalid ``bus`` section or adapter name
    """
    config = Configuration(configuration)
    remote = RemoteBus(BusConfig.from_mapping(bus)) if bus is not None else None
    batch_cls = load_adapter("batchsystems", config.BatchSystem.adapter)
    batch_adapter: Any = batch_cls()
    if remote is not None:
        batch_adapter = RemoteBatchSystemAdapter(batch_adapter, remote)
    batch_system_agent = BatchSystemAgent(batch_system_adapter=batch_adapter)
    plugins = load_plugins()
    plugin_list: list[Any] = [*plugins.values()]  # a real list: Drone.register_plugins appends
    if remote is not None:
        plugin_list.append(TardisStateNotes(remote))
    plugin_list.extend(_observers(observers))

    composites = []
    for site in config.Sites:
        site_cls = load_adapter("sites", site.adapter)
        site_composites = []
        for machine_type in getattr(config, site.name).MachineTypes:
            site_adapter: Any = site_cls(machine_type=machine_type, site_name=site.name)
            if remote is not None:
                site_adapter = RemoteSiteAdapter(site_adapter, remote)
            site_agent = SiteAgent(site_adapter)
            restored = [
                create_drone(
                    site_agent=site_agent,
                    batch_system_agent=batch_system_agent,
                    plugins=plugin_list,
                    **resource_attributes,
                )
                for resource_attributes in get_drones_to_restore(plugins, site, machine_type)
            ]
            drone_factory = partial(
                create_drone,
                site_agent=site_agent,
                batch_system_agent=batch_system_agent,
                plugins=plugin_list,
            )
            pool: Any
            if remote is not None:
                pool = RemoteFactoryPool(
                    *restored,
                    factory=drone_factory,
                    interval=interval,
                    bus=remote,
                    site=site_token(site.name),
                )
            else:
                pool = FactoryPool(*restored, factory=drone_factory, interval=interval)
            site_composites.append(Logger(pool, name=f"{site.name.lower()}_{machine_type.lower()}"))
        composites.append(
            Standardiser(
                WeightedComposite(*site_composites, weight="utilisation"),
                maximum=site.quota if site.quota >= 0 else infinity,
            )
        )
    return WeightedComposite(*composites, weight="utilisation")


# As a YAML tag, COBalD calls ``create_composite_pool.s(**mapping)`` at parse time
# (cobald/daemon/core/config.py); a leaf Partial defers the construction until the
# pipeline is built, after the ``tardis:`` section has filled TARDIS's configuration.
create_composite_pool.s = partial(Partial, create_composite_pool, __leaf__=True)  # type: ignore[attr-defined]


__all__ = [
    "TARDIS_EXCEPTIONS",
    "BusConfig",
    "RemoteBatchSystemAdapter",
    "RemoteBus",
    "RemoteFactoryPool",
    "RemoteSiteAdapter",
    "TardisStateNotes",
    "create_composite_pool",
    "load_adapter",
    "site_token",
]
