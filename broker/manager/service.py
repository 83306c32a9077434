"""
The manager side as one long-running service

:class:`ManagerService` owns the connection, the durable consumer on the event
stream, the watch on the handshake bucket, the registry, the periodic pass that
marks drones ended and lost and retires them, and the issuer's thread. Its rule:
:meth:`~ManagerService.run` never returns and never raises (COBalD aborts the daemon on
either); failures are logged and retried.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors

from broker.errors import BrokerError
from broker.jetstream.messages import ConsumerStats, PullSettings
from broker.jetstream.pull import PullConsumer
from broker.manager.control import DEFAULT_REQUEST_TIMEOUT_S, Control
from broker.manager.grants import GrantStore
from broker.manager.handler import event_handler, note_handler
from broker.manager.issuer import Issuer, IssuerSettings
from broker.manager.issuer_thread import IssuerThread
from broker.manager.lifecycle import DEFAULT_RETAIN_ENDED_S, DEFAULT_RETAIN_LOST_S
from broker.manager.rebuild import RebuildReport, rebuild
from broker.manager.records import watch_records
from broker.manager.registry import DEFAULT_LOST_AFTER_S, Registry
from broker.manager.retire import Retired, retire_ended
from broker.manager.views import DEFAULT_CLOCK_SKEW_WARN_S
from broker.server.auth.authority import load_issuer_key
from broker.server.durable import DEFAULT_DURABLE, durable_config, ensure_consumer
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace, api_prefix

log = logging.getLogger("cobald.runtime.cobald_remote.service")


@dataclass(frozen=True, slots=True)
class ManagerSettings:
    """
    How the manager connects and consumes

    :param servers: NATS URLs (several for a cluster)
    :param creds: NATS credentials file of the manager
    :param domain: JetStream domain (leaf-node deployments)
    :param durable: name of the durable consumer on the event stream
    :param lost_after_s: seconds without a sign of life after which a drone is lost
    :param lost_check_s: how often drones are checked for being ended, lost, or due
        for retirement
    :param retain_ended_s: seconds an ended drone is kept before it is retired
    :param retain_lost_s: seconds a drone not ended is kept after the newest fact about
        it before it is retired (``0``: never)
    :param clock_skew_warn_s: an agent whose clock is off the server's by more is warned
        about (the registry's ``clock_skew_warn_s``)
    :param retry_s: wait before reconnecting after the connection or the consumer failed
    :param request_timeout_s: how long commands wait for an agent's answer
    :param issuer: issue bootstrapped drones their identities (``None``: no issuer)
    """

    servers: Sequence[str] = ("nats://127.0.0.1:4222",)
    creds: str | None = None
    namespace: Namespace = field(default_factory=Namespace)
    domain: str | None = None
    durable: str = DEFAULT_DURABLE
    ack_wait_s: float = 30.0
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    lost_check_s: float = 5.0
    retain_ended_s: float = DEFAULT_RETAIN_ENDED_S
    retain_lost_s: float = DEFAULT_RETAIN_LOST_S
    clock_skew_warn_s: float = DEFAULT_CLOCK_SKEW_WARN_S
    retry_s: float = 5.0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    pull: PullSettings = field(default_factory=PullSettings)
    issuer: IssuerSettings | None = None


class ManagerService:
    """
    The registry kept current from the bus, and the control API over it

    ``await service.run()`` runs until :meth:`stop` (inside COBalD: forever).
    :attr:`registry` is usable from the start (empty until the first
    rebuild); :attr:`control` once :attr:`ready` is set.
    """

    def __init__(self, settings: ManagerSettings, registry: Registry | None = None) -> None:
        self.settings = settings
        if registry is None:
            registry = Registry(
                settings.namespace,
                lost_after_s=settings.lost_after_s,
                retain_ended_s=settings.retain_ended_s,
                retain_lost_s=settings.retain_lost_s,
                clock_skew_warn_s=settings.clock_skew_warn_s,
            )
        self.registry = registry
        self.control: Control | None = None
        self.ready = asyncio.Event()
        self.last_rebuild: RebuildReport | None = None
        self.failures = 0
        #: counters of the event stream's consumer, across reconnects
        self.consumer_stats = ConsumerStats()
        #: ended drones retired since the service started, and their records purged
        self.retired = Retired()
        #: the issuer while connected (with :attr:`ManagerSettings.issuer` set), else ``None``
        self.issuer: Issuer | None = None
        #: what the issuer did, across reconnects (:attr:`Issuer.counts`)
        self.issuer_counts: collections.Counter[str] = collections.Counter()
        self._stop = asyncio.Event()
        self._pulls: list[PullConsumer] = []
        self._api = api_prefix(settings.domain)
        #: the session is closing its connection itself (stop, cancel, or a failure)
        self._closing = False

    def stop(self) -> None:
        """Ask :meth:`run` to end (tests and the CLI; COBalD never stops it)"""
        self._stop.set()

    async def run(self) -> None:
        """Connect, rebuild, consume; on any failure log, wait and start over. Never raises."""
        while not self._stop.is_set():
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # never let one failure end the service
                self.failures += 1
                log.warning(
                    "manager session failed, retrying in %.0fs: %s",
                    self.settings.retry_s,
                    _describe(err),
                    exc_info=not isinstance(err, BrokerError | nats.errors.Error | OSError),
                )
            finally:
                self.ready.clear()
                self.control = None
            if not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.retry_s)

    async def _session(self) -> None:
        settings = self.settings
        self._closing = False
        nc = await connect(
            list(settings.servers),
            name="cobald-remote-manager",
            user_credentials=settings.creds,
            # fail the first connect after a few tries (the loop retries it, and
            # can be stopped meanwhile); once connected, reconnect forever
            max_reconnect_attempts=3,
            reconnect_time_wait=1.0,
            connect_timeout=5,
            reconnected_cb=self._reconnected,
            disconnected_cb=self._disconnected,
            error_cb=self._error,
        )
        nc.options["max_reconnect_attempts"] = -1  # read on every reconnect (-1: forever)
        try:
            js = nc.jetstream(domain=settings.domain)
            ns = self.registry.namespace
            config = durable_config(ns.all_events, settings.durable, ack_wait_s=settings.ack_wait_s)
            # TARDIS's notes on a durable of their own: the registry orders notes
            # and events by stream sequence, whichever consumer delivers first
            notes_config = durable_config(
                ns.all_manager_notes, f"{settings.durable}-notes", ack_wait_s=settings.ack_wait_s
            )
            # create the durables before the rebuild reads the stream's end, so
            # no event falls between the two
            await ensure_consumer(js, ns.event_stream, config)
            await ensure_consumer(js, ns.event_stream, notes_config)
            # the proof key first: the rebuild checks the records' proofs with it
            control = await Control.open(
                nc,
                self.registry,
                domain=settings.domain,
                request_timeout_s=settings.request_timeout_s,
            )
            issuer, serving = None, None
            if settings.issuer is not None:
                key = load_issuer_key(settings.issuer.key)
                # the requests are answered in a thread of its own, on connections of its
                # own; this connection's issuer mints tokens and purges grants
                serving = IssuerThread(
                    settings.issuer,
                    key,
                    self.registry,
                    servers=settings.servers,
                    creds=settings.creds,
                    domain=settings.domain,
                    counts=self.issuer_counts,
                    retry_s=settings.retry_s,
                )
                issuer = Issuer(
                    settings.issuer,
                    key,
                    await GrantStore.open(js, ns),
                    self.registry,
                    domain=settings.domain,
                    counts=self.issuer_counts,
                    serve_site=serving.serve_site,
                )
            report, feed = await rebuild(nc, js, self.registry, api=self._api)
            self.last_rebuild = report
            self.control = control
            consumer = PullConsumer(
                nc,
                ns.event_stream,
                settings.durable,
                event_handler(self.registry),
                headers=True,  # a relayed answer is told by its headers (validity.relayed)
                settings=settings.pull,
                api=self._api,
                stats=self.consumer_stats,
            )
            notes = PullConsumer(
                nc,
                ns.event_stream,
                f"{settings.durable}-notes",
                note_handler(self.registry),
                headers=True,
                settings=settings.pull,
                api=self._api,
                stats=self.consumer_stats,
            )
            self._pulls.extend((consumer, notes))
            try:
                if serving is not None:
                    await serving.start()  # after the rebuild: it reads which drones ended
                self.issuer = issuer
                self.ready.set()
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(consumer.run(self._stop)),
                        tg.create_task(notes.run(self._stop)),
                        tg.create_task(
                            watch_records(
                                nc, js, feed, self._stop, api=self._api, on_pull=self._pulls
                            )
                        ),
                        tg.create_task(self._liveness(js)),
                    ]
                    if serving is not None:
                        tasks.append(tg.create_task(serving.run(self._stop)))
                    await self._stop.wait()
                    for task in tasks:
                        task.cancel()
            finally:
                self._pulls.clear()
                self.issuer = None
                if serving is not None:
                    await serving.stop()
        finally:
            self._closing = True
            await close(nc)

    async def _liveness(self, js: nats.js.JetStreamContext) -> None:
        """Ended first (an ended drone is never lost), then lost, then retirement"""
        while not self._stop.is_set():
            now = time.time()
            self.registry.mark_ended(now)
            self.registry.mark_lost(now)
            grants = self.issuer.grants if self.issuer is not None else None
            done = await retire_ended(js, self.registry, now, grants=grants)
            if done.retired or done.purged or done.kept or done.retried:
                self.retired = _added(self.retired, done)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.lost_check_s)

    async def _reconnected(self) -> None:
        log.info("reconnected to NATS")
        for pull in list(self._pulls):
            await pull.reconnected()

    async def _disconnected(self) -> None:
        # nats-py calls this on close, too: on a stop, a cancel (COBalD's exit) or a failure
        if self._stop.is_set() or self._closing:
            log.info("disconnected from NATS: connection closed")
        else:
            log.warning("disconnected from NATS; reconnecting")

    async def _error(self, err: Exception) -> None:
        log.debug("nats: %r", err)


def _added(total: Retired, more: Retired) -> Retired:
    return Retired(
        total.retired + more.retired,
        total.purged + more.purged,
        total.kept + more.kept,
        total.retried + more.retried,
        total.lost + more.lost,
    )


def _describe(err: BaseException) -> str:
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in err.exceptions)
    return f"{type(err).__name__}: {err}"
