"""
:class:`RemoteBus`: the manager service inside COBalD, the facts the adapters read, TARDIS's notes

Importing it connects nothing; the bus runs only as a COBalD service.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import logging
import math
import time
import uuid

import nats.js.errors
from cobald.daemon.runners.service import ServiceUnit

from broker.manager.blackholes import BlackHoles
from broker.manager.control import Control
from broker.manager.metrics import MetricsServer, Sources
from broker.manager.registry import Registry
from broker.manager.service import ManagerService
from broker.manager.views import DroneView
from broker.tardis.config import BusConfig
from broker.tardis.failures import CallLog
from broker.tardis.release import Durations
from broker.tardis.wake import Waker
from remote_agent.protocol.environment import TARDIS_ENV_PREFIX, TARDIS_SETTINGS_ENV, site_of
from remote_agent.protocol.events import TARDIS_STATE, TardisState, encode, utcnow
from remote_agent.protocol.names import MSG_ID, Namespace
from remote_agent.protocol.transient import is_transient

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")


class BootstrapUnavailable(Exception):
    """A drone cannot get its token now: the issuer is not connected"""


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
        #: the log lines of the adapters' failed calls and deferred removals
        self.call_log = CallLog(log)
        #: every counter of the integration, by part: the bus, each site, the batch system
        self.count_sources: dict[str, collections.Counter[str]] = {"bus": self.counts}
        #: wakes the TARDIS drones whose agents' facts change (:mod:`broker.tardis.drone`)
        self.waker = Waker(lambda drone: self.announced(self.site_of(drone), drone) is not None)
        #: how long payloads ran, for the release order (:mod:`broker.tardis.release`)
        self.durations = Durations()
        #: black-hole drones per site, the sites flagged and their probe drones
        self.black_holes = BlackHoles(config.black_hole_rules())
        self.registry.watchers.extend((self.waker.seen, self.durations.seen, self.black_holes.seen))
        #: why the pool released each drone, by uuid: the reason its drain carries
        self.release_reasons: dict[str, str] = {}
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
                    issuer_counts=(
                        (lambda: self.manager.issuer_counts)
                        if self.manager.settings.issuer is not None
                        else None
                    ),
                    retired=lambda: self.manager.retired,
                    state_runs_delayed=lambda: self.waker.counts["state_runs_delayed"],
                    noisy_state_runs=self.waker.noisy,
                    black_holes=self.black_holes,
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
        """The site of ``drone``: as a site adapter saw it, else as its uuid names it"""
        known = self.sites.get(drone)
        if known is not None:
            return known
        return site_of(drone) or drone

    def announced(self, site: str, drone: str) -> DroneView | None:
        """The drone's view if its agent announced itself (an event, not just a record)"""
        view = self.registry.view(site, drone)
        return view if view is not None and view.encoded is not None else None

    def fresh(self, site: str, drone: str, now: float | None = None) -> DroneView | None:
        """
        The drone's view if its agent announced itself and is not lost, else ``None``

        "Fresh" is the rule for answering from the registry instead of the
        wrapped adapters: the agent was heard from within ``lost_after_s``.
        """
        view = self.announced(site, drone)
        if view is None:
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
        if record is not None and record.drain_due is not None:
            deadline = max(deadline, record.drain_due)
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
        if self.config.bootstrap_creds:
            values["bootstrap_creds"] = self.config.bootstrap_creds.replace("{site}", site)
        return {
            TARDIS_SETTINGS_ENV[name].removeprefix(TARDIS_ENV_PREFIX): value
            for name, value in values.items()
        }

    async def mint(self, site: str, drone: str) -> dict[str, str]:
        """
        The environment a drone job needs to bootstrap: its new one-time token

        Nothing without an issuer (``bus.bootstrap_key`` not set).

        :raises BootstrapUnavailable: if the issuer is configured but not connected
        """
        if self.config.bootstrap_key is None:
            return {}
        issuer = self.manager.issuer
        if issuer is None:
            raise BootstrapUnavailable("the bus is not connected: no token for the drone")
        token = await issuer.mint(site, drone)
        return {TARDIS_SETTINGS_ENV["token"].removeprefix(TARDIS_ENV_PREFIX): token}

    def drain_deadline(self) -> dt.datetime:
        return utcnow() + dt.timedelta(seconds=self.config.drain_deadline_s)

    # ------------------------------------------------------------ notes

    @property
    def pending_notes(self) -> tuple[TardisState, ...]:
        """TARDIS state notes not yet published, oldest first"""
        return tuple(self._notes)

    def note_state(self, site: str, drone: str, state: str, resource_status: str) -> None:
        """Queue a TARDIS state note for publishing; never blocks, never raises"""
        self.tardis_states[drone] = state
        if state == "DownState":
            self.release_reasons.pop(drone, None)
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
            subject = self.namespace.manager_note(note.site, note.drone, TARDIS_STATE)
            try:
                js = control.nc.jetstream(domain=self.config.domain)
                await js.publish(subject, encode(note), timeout=5.0, headers={MSG_ID: note.id})
            except Exception as err:
                if is_transient(err):
                    self.counts["notes_retried"] += 1
                    log.debug("cannot publish a TARDIS note yet: %r", err)
                    await asyncio.sleep(retry_s)
                    continue
                self.counts["notes_dropped"] += 1
                if isinstance(err, nats.js.errors.APIError):  # refused: it would block the rest
                    log.warning(
                        "the stream refused a TARDIS note for %s, dropping it: %s", note.drone, err
                    )
                else:  # a bug must not stop the daemon
                    log.exception("dropping TARDIS note for %s", note.drone)
            else:
                self.counts["notes_published"] += 1
            if self._notes and self._notes[0] is note:
                self._notes.popleft()
