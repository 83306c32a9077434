"""
The issuer in a thread of its own: its own event loop, its own NATS connections

A site's bootstrap credentials sit on every worker node of the site, so whatever they can
send, somebody will. Its rule: nothing sent on one site's bootstrap subject reaches the
manager's event loop or connection, or waits behind another site's requests:

- every site's requests arrive on a connection of their own, so what nats-server holds
  for a flooding site (up to its ``max_pending``, after which it cuts that connection)
  holds up that site alone; replies and the grants bucket use one more connection;
- a request joins its site's bounded line as it arrives
  (:class:`~broker.manager.sitequeues.SiteQueues`), or is dropped and counted right
  there, before it is decoded or given a task; after a line's worth of drops the site's
  connection is not read for a moment, so a flood costs this thread a bounded share of
  the interpreter whatever its rate (the server holds the rest, for that site);
- a fixed number of workers take the sites in turn and decide (:meth:`Issuer.answer`).

The sites are those with a grant: listed at the start, and added as grants are written
(a core subscription on the bucket's subjects, so another manager's mints count too).
A request of a site without one finds no responder: it could only be refused. The thread,
its loop and its connections live exactly as long as the manager's session that started
them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from broker.jetstream.fastpath import route
from broker.manager.grants import GrantStore
from broker.manager.issuer import QUEUE, QUEUE_FULL, Issuer, IssuerSettings
from broker.manager.registry import Registry
from broker.manager.sitequeues import MAX_SITES, SiteQueues
from broker.server.auth.authority import IssuerKey
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import is_token
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.issuer")

#: the name of the issuer's thread
THREAD_NAME: Final = "cobald-remote-issuer"
#: how long a site's connection is not read after a line's worth of drops, seconds
DROP_PAUSE_S: Final = 0.01
#: how long a stop waits for the thread to close its connections and end
_STOP_WAIT_S: Final = 10.0
#: how long a mint waits for its site to be served, when the site is new
_SERVE_WAIT_S: Final = 5.0

#: one waiting request: its reply subject and its bytes, as they arrived
_Request = tuple[str, bytes]


class IssuerThread:
    """
    Serves the bootstrap requests of every site in a thread of its own

    :meth:`start` it, then :meth:`run` it in the manager's session; :meth:`stop` ends the
    thread and closes its connections (:meth:`run` does, whichever way it ends).

    ``counts`` is the manager's issuer counter: the thread adds to it (every count but
    ``minted``) before it answers, so a reader in another thread copies it first
    (``dict(counts)``, which the GIL makes one step).

    :param registry: the manager's registry, only read (with :meth:`Registry.view`: its
        views are immutable and replaced whole, so a view read here is one whole state)
    :param servers: the NATS URLs the manager connects to
    :param creds: the manager's credentials file
    :param domain: JetStream domain of the grants bucket
    :param retry_s: wait before a site's connection is tried again after its first
        attempts failed
    """

    def __init__(
        self,
        settings: IssuerSettings,
        key: IssuerKey,
        registry: Registry,
        *,
        servers: Sequence[str],
        creds: str | None,
        domain: str | None,
        counts: collections.Counter[str],
        retry_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.counts = counts
        self._key = key
        self._registry = registry
        self._servers = list(servers)
        self._creds = creds
        self._domain = domain
        self._retry_s = retry_s
        self._say = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        #: set once (from any thread) to end the thread
        self._stopping = threading.Event()
        #: the thread's loop and the event that :meth:`stop` sets in it, once it runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        #: done when the thread serves (or could not start), and when it ended
        self._serving: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        # in the thread only:
        self._queues: SiteQueues[_Request] = SiteQueues(settings.site_queue)
        self._sites: dict[str, asyncio.Task[None]] = {}
        self._served: set[str] = set()
        self._waiting: dict[str, list[concurrent.futures.Future[None]]] = {}

    # ------------------------------------------------------------ the manager's side

    async def start(self) -> None:
        """
        Start the thread; return once it answers the requests of every site with a grant

        :raises Exception: what kept it from connecting (it has ended then)
        """
        self._thread.start()
        await asyncio.wrap_future(self._serving)

    async def run(self, stop: asyncio.Event) -> None:
        """
        Until ``stop`` is set or the thread ends; the thread is stopped either way

        :raises Exception: what ended the thread, if ``stop`` was not set
        """
        stopped = asyncio.ensure_future(stop.wait())
        ended = asyncio.wrap_future(self._ended)
        try:
            await asyncio.wait((stopped, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            await self.stop()
        if ended.done() and not stop.is_set():
            ended.result()  # raises what ended it

    async def stop(self) -> None:
        """End the thread and wait for it (at most a few seconds: it is a daemon thread)"""
        self._stopping.set()
        self._call(self._wake)
        if not self._thread.is_alive():
            return
        await asyncio.to_thread(self._thread.join, _STOP_WAIT_S)
        if self._thread.is_alive():
            log.warning("the issuer's thread did not end within %.0fs", _STOP_WAIT_S)

    async def serve_site(self, site: str) -> None:
        """
        Answer ``site``'s requests (it has a grant now); return once they are, or after a
        few seconds (its connection is then still being tried)
        """
        served: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not self._call(self._add_site, site, served):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(served), _SERVE_WAIT_S)

    def _call(self, function: Any, *args: object) -> bool:
        """Call ``function(*args)`` in the thread's loop; ``False`` if it does not run"""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # its loop has closed: the thread is ending
            return False
        return True

    # ------------------------------------------------------------ in the thread

    def _wake(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as err:  # told to the manager's loop, which raises it
            if not self._serving.done():
                self._serving.set_exception(err)
            self._ended.set_exception(err)
        else:
            if not self._serving.done():
                self._serving.set_result(None)
            self._ended.set_result(None)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()  # after _stop: stop() reads them in turn
        if self._stopping.is_set():
            return
        nc = await self._connect("cobald-remote-issuer")
        try:
            namespace = self._registry.namespace
            grants = await GrantStore.open(nc.jetstream(domain=self._domain), namespace)
            issuer = Issuer(
                self.settings,
                self._key,
                grants,
                self._registry,
                domain=self._domain,
                counts=self.counts,
            )

            async def written(msg: Msg) -> None:  # any grant's write: its site is one to serve
                self._add_site(msg.subject.removeprefix(grants.subjects[:-1]).partition(".")[0])

            await nc.subscribe(grants.subjects, cb=written)  # before the list: no gap
            first: list[concurrent.futures.Future[None]] = []
            for site in sorted(await grants.sites()):
                served: concurrent.futures.Future[None] = concurrent.futures.Future()
                first.append(served)
                self._add_site(site, served)
            await asyncio.gather(*(asyncio.wrap_future(served) for served in first))
            log.info(
                "issuing drone identities on %s in a thread of its own (%d sites; %d requests"
                " of a site wait at most)",
                namespace.all_bootstrap,
                len(self._sites),
                self.settings.site_queue,
            )
            self._serving.set_result(None)
            async with asyncio.TaskGroup() as tg:
                workers = [
                    tg.create_task(self._work(nc, issuer)) for _ in range(self.settings.in_flight)
                ]
                await self._stop.wait()
                for worker in workers:
                    worker.cancel()
        finally:
            sites = list(self._sites.values())
            for task in sites:
                task.cancel()
            await asyncio.gather(*sites, return_exceptions=True)
            await close(nc)

    async def _connect(self, name: str) -> Client:
        nc = await connect(
            self._servers,
            name=name,
            user_credentials=self._creds,
            # fail the first connect after a few tries; once connected, reconnect forever
            max_reconnect_attempts=3,
            reconnect_time_wait=1.0,
            connect_timeout=5,
            disconnected_cb=self._disconnected(name),
            reconnected_cb=self._reconnected(name),
            error_cb=self._error,
        )
        nc.options["max_reconnect_attempts"] = -1  # read on every reconnect (-1: forever)
        return nc

    def _add_site(self, site: str, served: concurrent.futures.Future[None] | None = None) -> None:
        """Serve ``site`` (once); ``served`` is done when it is, or when it cannot be"""
        if site in self._served or not is_token(site) or self._stopping.is_set():
            if served is not None and not served.done():
                served.set_result(None)
            return
        if served is not None:
            self._waiting.setdefault(site, []).append(served)
        if site in self._sites:
            return
        if len(self._sites) >= MAX_SITES:
            self._say.warning(
                "sites", "the issuer serves %d sites at most: not site %s", MAX_SITES, site
            )
            self._tell(site)
            return
        self._sites[site] = asyncio.get_running_loop().create_task(self._site(site))

    def _tell(self, site: str) -> None:
        for served in self._waiting.pop(site, ()):
            if not served.done():
                served.set_result(None)

    async def _site(self, site: str) -> None:
        """One site's connection and subscription, for as long as the thread runs"""
        subject = self._registry.namespace.bootstrap(site)
        line = _Line(self._queues, site, self.settings.site_queue, self._dropped)
        while True:
            try:
                nc = await self._connect(f"cobald-remote-issuer-{site}")
            except Exception as err:  # the server: tried again, meanwhile the site waits
                self._tell(site)
                log.warning(
                    "the issuer cannot connect for site %s, retrying in %.0fs: %r",
                    site,
                    self._retry_s,
                    err,
                )
                await asyncio.sleep(self._retry_s)
                continue
            try:
                subscription = await nc.subscribe(subject, queue=QUEUE, cb=line.delivered)
                route(nc, subscription, line.arrived)
                await nc.flush()
                self._served.add(site)
                self._tell(site)
                await asyncio.Future()  # until cancelled: nats-py reconnects it meanwhile
            except Exception as err:  # its connection closed for good: a new one
                log.warning("the issuer's connection for site %s failed: %r", site, err)
            finally:
                self._served.discard(site)
                await close(nc)
            await asyncio.sleep(self._retry_s)

    def _dropped(self, site: str) -> None:
        self.counts[QUEUE_FULL + site] += 1
        self._say.warning(
            f"full {site}",
            "dropped a bootstrap request of site %s unread: %d of its requests wait already"
            " (a flood from its bootstrap identity, or more of its drones asking at once"
            " than the issuer answers)",
            site,
            self.settings.site_queue,
            extra={"site": site},
        )

    async def _work(self, nc: Client, issuer: Issuer) -> None:
        while True:
            site, (reply, data) = await self._queues.take()
            await issuer.answer(nc, site, reply, data)
            await asyncio.sleep(0)  # let the readers in between: they queue the others

    def _disconnected(self, name: str) -> Callable[[], Awaitable[None]]:
        async def disconnected() -> None:
            if not self._stopping.is_set():
                self._say.warning(
                    f"lost {name}",
                    "the issuer's connection %s to NATS was lost; reconnecting",
                    name,
                )

        return disconnected

    def _reconnected(self, name: str) -> Callable[[], Awaitable[None]]:
        async def reconnected() -> None:
            log.info("the issuer's connection %s reconnected to NATS", name)

        return reconnected

    async def _error(self, err: Exception) -> None:
        log.debug("nats (issuer): %r", err)


class _Line:
    """What arrives on one site's connection: into its line, or dropped and counted"""

    def __init__(
        self,
        queues: SiteQueues[_Request],
        site: str,
        room: int,
        dropped: Callable[[str], None],
    ) -> None:
        self._queues = queues
        self._site = site
        self._room = room
        self._count = dropped
        #: drops since the connection was last left unread for a moment
        self._drops = 0

    def arrived(
        self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> Awaitable[None] | None:
        """Straight from the parser: the whole cost of a request whose line is full"""
        if self._queues.offer(self._site, (reply.decode("utf-8", "replace"), data)):
            return None
        return self._dropped()

    async def delivered(self, msg: Msg) -> None:
        """nats-py's path, when it allows no direct route"""
        if not self._queues.offer(self._site, (msg.reply, msg.data)):
            pause = self._dropped()
            if pause is not None:
                await pause

    def _dropped(self) -> Awaitable[None] | None:
        self._count(self._site)
        self._drops += 1
        if self._drops < self._room:
            return None
        # the parser awaits this before it reads on: the server holds what comes
        # meanwhile, for this site's connection alone
        self._drops = 0
        return asyncio.sleep(DROP_PAUSE_S)
