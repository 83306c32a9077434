"""
The agent's connection to NATS: retried forever, with a fixed or a renewed identity

:class:`Connection` connects with a ``.creds`` file or with the drone's bootstrapped
identity (:class:`Identity`), makes its subscriptions again on every new client, and says
why it cannot get through at most once a minute. A refusal of the credentials closes it
for good and is told to its listeners; an identity's JWT that expired is renewed instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from remote_agent.protocol.connect import (
    close,
    connect,
    credentials_refused,
    error_text,
    permissions_violation,
)
from remote_agent.protocol.names import DEFAULT_INBOX
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

#: the refusal of a JWT that expired (:func:`credentials_refused`): with an identity that is
#: renewed, the drone connects again once it has the new JWT
_EXPIRED: Final = "user authentication expired"


class Identity(Protocol):
    """An identity whose JWT may change (:class:`~remote_agent.agent.identity.BootstrapIdentity`)"""

    ready: asyncio.Event

    def user_jwt(self) -> bytes: ...

    def sign(self, nonce: str) -> bytes: ...


#: seconds between two lines saying that the agent still cannot get through
SAY_EVERY_S = 60.0


class Connection:
    """
    One client connection, connected by :meth:`connect` and kept up by nats-py

    :param servers: NATS URLs
    :param name: client name shown by the server (``connz``)
    :param creds: NATS credentials file
    :param inbox_prefix: prefix of reply subjects, so per-drone permissions can
        allow exactly this drone's inboxes
    :param publish_timeout_s: seconds a JetStream call waits for its answer
    :param reconnect_wait_s: seconds between connection attempts
    :param domain: JetStream domain of the event stream and the handshake bucket (leaf nodes)
    :param identity: connect with this identity's JWT instead of ``creds``, once it is ready
    """

    def __init__(
        self,
        servers: Sequence[str],
        *,
        name: str = "cobald-remote-agent",
        creds: Path | None = None,
        inbox_prefix: str = DEFAULT_INBOX,
        publish_timeout_s: float = 5.0,
        reconnect_wait_s: float = 2.0,
        domain: str | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.identity = identity
        #: every subscription made through :meth:`subscribe`, made again on a new client
        self._subscriptions: list[tuple[str, Callable[[Msg], Awaitable[None]]]] = []
        #: a reconnect asked for by :meth:`rotate` (not an outage)
        self._rotating = False
        self.domain = domain
        self.servers = list(servers)
        self.name = name
        self.creds = creds
        self.inbox_prefix = inbox_prefix
        self.publish_timeout_s = publish_timeout_s
        self.reconnect_wait_s = reconnect_wait_s
        #: set while the client is connected
        self.connected = asyncio.Event()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._listeners: list[Callable[[], None]] = []
        self._refused: list[Callable[[str], None]] = []
        self._connect_errors = 0
        #: when the current run of failed attempts began
        self._failing_since = time.monotonic()
        self._say = RateLimitedLog(log, SAY_EVERY_S)
        self._closing = False
        #: why the broker refused the credentials and closed the connection, for good
        self.refused: str | None = None
        #: the broker refused one of the drone's own subjects: the credentials are another's
        self.not_ours = False

    @property
    def nc(self) -> Client | None:
        """The client, once the first connect succeeded"""
        return self._nc

    @property
    def failed_attempts(self) -> int:
        """Connection attempts failed since the client was last connected"""
        return self._connect_errors

    @property
    def js(self) -> JetStreamContext | None:
        return self._js

    def on_connect(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (synchronously) after the first connect and every reconnect"""
        self._listeners.append(listener)

    def on_refused(self, listener: Callable[[str], None]) -> None:
        """
        Call ``listener(reason)`` when the broker refused the credentials and closed for good

        nats-py does not reconnect a client that the server closed with an error
        (nats/aio/client.py, ``_process_err``): the agent is off the bus from then on.
        """
        self._refused.append(listener)

    def _on_connected(self) -> None:
        """Called on every connect and reconnect, before the listeners"""

    def _backlog(self) -> int:
        """Events waiting to be sent"""
        return 0

    async def _error(self, err: Exception) -> None:
        if self._closing:
            log.debug("nats, while closing: %r", err)
            return
        if permissions_violation(err):
            self._not_ours(err)
            return
        if not self._connect_errors:
            self._failing_since = time.monotonic()
        self._connect_errors += 1
        reason = credentials_refused(err)
        if reason == _EXPIRED and self.identity is not None:
            reason = None  # renewed by the identity: _closed says what happens
        if reason is not None:
            self._say.log(
                logging.ERROR,
                "refused",
                "the broker refused this drone's credentials (%s): they were revoked or are"
                " invalid; %s (trying for %.0fs)",
                reason,
                "events wait in the spool" if self._nc else "the gate stays shut",
                self._failing_for(),
            )
        elif self._nc is None:  # the first connect: the record is not claimed yet
            self._say.log(
                logging.WARNING,
                "unreachable",
                "cannot reach the broker at %s (%s); the gate stays shut until the agent gets"
                " through and claims its record (trying for %.0fs)",
                ", ".join(self.servers),
                err,
                self._failing_for(),
            )
        # one line per outage at warning level, the rest at debug: a drone can wait for hours
        elif self._connect_errors == 1 or not (
            self.connected.is_set() or self._connect_errors % 100
        ):
            log.warning("nats: %s (errors so far: %d)", error_text(err), self._connect_errors)
        else:
            log.debug("nats: %s", error_text(err))

    def _not_ours(self, err: Exception) -> None:
        """
        The server refused one of this drone's own subjects: the credentials are another's

        The agent's connection uses its own events, record, commands and inboxes alone,
        which its own credentials all allow; refused one, it is off the bus as if refused
        for good (its listeners shut the gate and drain), but the connection stays up.
        """
        if self.refused is not None:
            log.debug("nats: %s", error_text(err))
            return
        self.not_ours = True
        self.refused = f"these credentials are not this drone's ({error_text(err)})"
        log.error(
            "the broker refuses this drone's own subjects (%s): these credentials are not this"
            " drone's (issued for another drone or site?). Give the drone its own (cobald-remote"
            " auth drone UUID --site SITE, or a bootstrap token), or check --drone, --site,"
            " --prefix and --domain; the gate is shut and the drone drains",
            error_text(err),
        )
        for listener in self._refused:
            listener(self.refused)

    def _failing_for(self) -> float:
        return time.monotonic() - self._failing_since

    async def _disconnected(self) -> None:
        nc = self._nc
        # a refusal closes the client for good: _closed says so
        if self._rotating:
            log.info("reconnecting with the renewed identity")
        elif self.connected.is_set() and not credentials_refused(nc.last_error if nc else None):
            log.warning("disconnected from the broker; events wait in the spool")
        self.connected.clear()

    async def _reconnected(self) -> None:
        self._rotating = False
        url = self._nc.connected_url.netloc if self._nc and self._nc.connected_url else "?"
        log.info("reconnected to %s; %d events to catch up", url, self._backlog())
        self._connected()

    async def _closed(self) -> None:
        self.connected.clear()
        nc = self._nc
        if self._closing or nc is None:
            return
        err = nc.last_error
        reason = credentials_refused(err)
        if reason == _EXPIRED and self.identity is not None:
            log.warning(
                "this drone's identity expired before the issuer renewed it; events wait in"
                " the spool until it does"
            )
            return
        if reason is None:
            log.error(
                "the broker closed the connection for good (%s); events wait in the spool", err
            )
            return
        self.refused = reason
        log.error(
            "the broker refused this drone's credentials (%s) and closed the connection: they"
            " were revoked or expired; the gate is shut and the drone drains (the next drone"
            " job needs new credentials: cobald-remote auth drone)",
            reason,
        )
        for listener in self._refused:
            listener(reason)

    def _connected(self) -> None:
        self._connect_errors = 0
        self._say = RateLimitedLog(log, SAY_EVERY_S)
        self.connected.set()
        self._on_connected()
        for listener in self._listeners:
            listener()

    async def connect(self) -> Client:
        """Connect, retrying for as long as it takes"""
        auth: dict[str, Any] = {"user_credentials": str(self.creds) if self.creds else None}
        if self.identity is not None:
            await self.identity.ready.wait()
            auth = {"user_jwt_cb": self.identity.user_jwt, "signature_cb": self.identity.sign}
        nc = await connect(
            self.servers,
            name=self.name,
            **auth,
            inbox_prefix=self.inbox_prefix,
            max_reconnect_attempts=-1,
            reconnect_time_wait=self.reconnect_wait_s,
            connect_timeout=2,
            error_cb=self._error,
            disconnected_cb=self._disconnected,
            reconnected_cb=self._reconnected,
            closed_cb=self._closed,
        )
        try:
            for subject, callback in self._subscriptions:
                await nc.subscribe(subject, cb=callback)
        except BaseException:
            await close(nc)
            raise
        self._nc = nc
        self._js = nc.jetstream(timeout=self.publish_timeout_s, domain=self.domain)
        url = nc.connected_url.netloc if nc.connected_url else "?"
        if self._connect_errors:
            log.info(
                "connected to %s after %d failed attempts in %.0fs",
                url,
                self._connect_errors,
                self._failing_for(),
            )
        else:
            log.info("connected to %s", url)
        self._connected()
        return nc

    # ------------------------------------------------------------------ publishing

    async def subscribe(self, subject: str, callback: Callable[[Msg], Awaitable[None]]) -> None:
        """Subscribe now if connected, and again on every new client"""
        self._subscriptions.append((subject, callback))
        nc = self._nc
        if nc is not None and not nc.is_closed:
            await nc.subscribe(subject, cb=callback)

    async def rotate(self) -> None:
        """
        Connect with the identity's renewed JWT: reconnect the client, or, if the server
        closed it because the old JWT expired, connect a new one
        """
        nc = self._nc
        if nc is None or self._closing or self.refused is not None:
            return  # the first connect picks the new JWT itself
        if not nc.is_closed:
            if nc.is_connected:
                self._rotating = True
                await nc.force_reconnect()  # nats-py asks user_jwt() again
            return
        log.info("connecting again with the renewed identity")
        await self._connect_retrying()

    async def _connect_retrying(self) -> None:
        while True:
            try:
                await self.connect()
                return
            except Exception as err:  # nats-py retries refusals and I/O itself (-1 attempts)
                self._say.log(
                    logging.ERROR,
                    "connect",
                    "cannot connect to %s: %r; the gate stays shut",
                    ", ".join(self.servers),
                    err,
                )
                await asyncio.sleep(max(self.reconnect_wait_s, 1.0))

    async def close(self) -> None:
        """Close the connection; events still spooled stay on disk"""
        self._closing = True
        nc, self._nc = self._nc, None
        self.connected.clear()
        if nc is not None:
            await close(nc)
