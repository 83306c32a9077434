"""
Prometheus metrics of the manager: the exposition and its HTTP endpoint

:class:`MetricsServer` serves ``GET /metrics`` (``bus.metrics``,
``docs/operations.md``) with prometheus_client's WSGI application in a thread of
its own, so a scrape never blocks the event loop; it never raises into the manager.
The families are :class:`~broker.manager.collector.ManagerCollector`'s.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from broker.errors import BrokerError
from broker.manager.collector import Sources, collector_registry
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.metrics")
_failures = RateLimitedLog(log)

#: the Content-Type of the text exposition format, unless the scraper asks for OpenMetrics
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: a scraper that has not sent its request after this long is disconnected
CLIENT_TIMEOUT_S: Final = 10.0

__all__ = ["CONTENT_TYPE", "MetricsServer", "Sources", "parse_address", "render"]

_StartResponse = Callable[..., Any]


def render(sources: Sources, now: float | None = None) -> str:
    """
    The metrics as Prometheus text (version 0.0.4), as a scrape gets them

    :param now: the time to judge lost drones by, epoch seconds (default: now)
    """
    clock = time.time if now is None else (lambda: now)
    return generate_latest(collector_registry(sources, clock)).decode()


def parse_address(value: str) -> tuple[str, int]:
    """
    ``host:port`` (``[v6]:port``, or a bare port for loopback) as ``(host, port)``

    :raises ValueError: for anything else, or a port outside 0-65535
    """
    text = str(value).strip()
    if text.isdigit():
        host, port_text = "127.0.0.1", text
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or not port_text.isdigit():
            raise ValueError(f"metrics address {value!r} is not host:port (e.g. 127.0.0.1:9464)")
        host = host.removeprefix("[").removesuffix("]")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port {port} is outside 0-65535")
    return host, port


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, no access log; a silent client is cut off"""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # the stdlib prints a traceback to stderr; a scraper that went away is no news
        log.debug("metrics request from %s failed: %r", client_address, sys.exc_info()[1])


class MetricsServer:
    """
    ``GET /metrics`` over HTTP, answered from ``sources`` on every request

    :param host: address to bind (loopback unless the scraper is elsewhere)
    :param port: port to bind, ``0`` for a free one (see :attr:`port` once started)
    :param client_timeout_s: a client silent for this long is disconnected
    """

    def __init__(
        self,
        sources: Sources,
        host: str = "127.0.0.1",
        port: int = 9464,
        *,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
    ) -> None:
        self.sources = sources
        self.host = host
        self.port = port
        self.client_timeout_s = client_timeout_s
        self.registry: CollectorRegistry = collector_registry(sources)
        self._exposition = make_wsgi_app(self.registry)
        self._scrapes = 0
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def scrapes(self) -> int:
        """Requests for ``/metrics`` answered so far"""
        return self._scrapes

    async def start(self) -> None:
        """
        Bind and serve in a thread of its own

        :raises BrokerError: if the address cannot be bound
        """
        try:
            server = await asyncio.to_thread(self._bind)
        except OSError as err:
            raise BrokerError(
                f"cannot serve metrics on {self.host}:{self.port}: {err.strerror or err}"
            ) from err
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, name="cobald-remote-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    def _bind(self) -> WSGIServer:
        family, *_, address = socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        handler = type("Handler", (_QuietHandler,), {"timeout": self.client_timeout_s})
        server_class = type("Server", (_Server,), {"address_family": family})
        return make_server(
            str(address[0]), self.port, self._app, server_class, handler_class=handler
        )

    async def close(self) -> None:
        """Stop serving and release the port (requests in flight finish on their own)"""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)  # waits for serve_forever to return
        server.server_close()
        if thread is not None:
            await asyncio.to_thread(thread.join)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; a failure to bind is logged, not raised"""
        try:
            await self.start()
        except BrokerError as err:
            log.error("%s; running without metrics", err)
            return
        try:
            await stop.wait()
        finally:
            await self.close()

    def _app(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        """The WSGI application: ``/metrics`` only, and no exception into the server"""
        text = [("Content-Type", "text/plain; charset=utf-8")]
        if environ.get("REQUEST_METHOD") != "GET":
            start_response("405 Method Not Allowed", [*text, ("Allow", "GET")])
            return [b"only GET\n"]
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", text)
            return [b"metrics are at /metrics\n"]
        try:
            body = self._exposition(environ, start_response)
        except Exception as err:  # a bug in a source: the scrape fails, the manager goes on
            kind = type(err).__name__
            if _failures.log(logging.ERROR, kind, "metrics scrape failed: %s: %s", kind, err):
                log.debug("metrics scrape failed", exc_info=True)
            start_response("500 Internal Server Error", text, None)
            return [b"metrics failed; see the manager's log\n"]
        with self._lock:
            self._scrapes += 1
        return list(body)
