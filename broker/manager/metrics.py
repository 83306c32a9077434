"""
Prometheus metrics of the manager, rendered from the counters its parts keep

Nothing here keeps state of its own. :class:`MetricsServer` serves ``GET
/metrics`` (``bus.metrics``, ``docs/operations.md``) with just enough HTTP/1.1
for a scraper, and never raises into the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from broker.errors import BrokerError
from broker.jetstream.messages import ConsumerStats
from broker.manager.registry import Registry
from remote_agent.protocol.events import DroneState, RecordPhase

log = logging.getLogger("broker.metrics")

#: the Content-Type of the text exposition format
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: a scraper that has not sent its request after this long is disconnected
CLIENT_TIMEOUT_S: Final = 10.0
_MAX_REQUEST: Final = 8192
_PREFIX: Final = "cobald_remote_"


@dataclass(frozen=True, slots=True)
class Sources:
    """
    Where the numbers come from (each part is optional)

    :param registry: the drone registry
    :param consumer: counters of the event stream's consumer (kept across reconnects)
    :param connected: whether the manager is connected and consuming
    :param failures: manager sessions that failed (connection, consumer) so far
    :param rebuild_seconds: how long the last rebuild took
    :param tardis_calls: what the TARDIS integration did: by part (``bus``,
        ``site:<name>``, ``batch_system``), counts by name
    :param notes_buffered: TARDIS state notes waiting for the bus
    """

    registry: Registry
    consumer: ConsumerStats | None = None
    connected: Callable[[], bool] | None = None
    failures: Callable[[], int] | None = None
    rebuild_seconds: Callable[[], float | None] | None = None
    tardis_calls: Callable[[], Mapping[str, Mapping[str, int]]] | None = None
    notes_buffered: Callable[[], int] | None = None


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(
    lines: list[str],
    name: str,
    kind: str,
    help_text: str,
    samples: Iterable[tuple[Mapping[str, str], float]],
) -> None:
    # counters are named with their _total in all three lines, as in format 0.0.4
    sample_name = _PREFIX + name + ("_total" if kind == "counter" else "")
    lines.append(f"# HELP {sample_name} {help_text}")
    lines.append(f"# TYPE {sample_name} {kind}")
    for labels, value in samples:
        text = ",".join(f'{key}="{_label(str(v))}"' for key, v in labels.items())
        number = repr(float(value)) if isinstance(value, float) else str(value)
        lines.append(f"{sample_name}{{{text}}} {number}" if text else f"{sample_name} {number}")


def render(sources: Sources, now: float | None = None) -> str:
    """
    The metrics as Prometheus text (version 0.0.4)

    Drone counts by state and by handshake phase list every state and phase,
    zeros included, so that their series exist from the first scrape.

    :param now: the time to judge lost drones by, epoch seconds (default: now)
    """
    now = time.time() if now is None else now
    registry = sources.registry
    metrics = registry.metrics()
    views = registry.views()
    lost_after_s = registry.lost_after_s
    by_state = dict.fromkeys([str(state) for state in DroneState] + ["unknown"], 0)
    by_phase = dict.fromkeys([str(phase) for phase in RecordPhase] + ["tampered", "none"], 0)
    lost = 0
    for view in views.values():
        by_state[str(view.state) if view.state is not None else "unknown"] += 1
        by_phase[view.record.label if view.record is not None else "none"] += 1
        lost += view.is_lost(now, lost_after_s)

    lines: list[str] = []
    _family(
        lines,
        "registry_events",
        "counter",
        "Events the registry handled, by outcome (rejected: see registry_rejected)",
        [
            ({"outcome": "applied"}, metrics.applied),
            ({"outcome": "duplicate"}, metrics.duplicate),
            ({"outcome": "stale"}, metrics.stale),
        ],
    )
    _family(
        lines,
        "registry_rejected",
        "counter",
        "Events and records rejected as invalid, by reason; they changed nothing",
        [({"reason": reason}, count) for reason, count in sorted(metrics.rejected.items())],
    )
    _family(
        lines,
        "registry_records",
        "counter",
        "Handshake-bucket values merged into the registry, by outcome",
        [
            ({"outcome": "applied"}, metrics.records_applied),
            ({"outcome": "ignored"}, metrics.records_ignored),
        ],
    )
    _family(
        lines,
        "drones",
        "gauge",
        "Drones known to the registry, by the state of their newest event "
        "(unknown: only a handshake record)",
        [({"state": state}, count) for state, count in by_state.items()],
    )
    _family(
        lines,
        "drone_records",
        "gauge",
        "Drones by the phase of their handshake record (none: no record)",
        [({"phase": phase}, count) for phase, count in by_phase.items()],
    )
    _family(
        lines,
        "drones_lost",
        "gauge",
        "Drones whose agent was silent for longer than lost_after_s",
        [({}, lost)],
    )
    stats = sources.consumer
    if stats is not None:
        _family(
            lines,
            "consumer_messages",
            "counter",
            "Event-stream messages the manager's consumer handled, by what it answered "
            "(termed: rejected, or the handler raised)",
            [
                ({"outcome": "acked"}, stats.acked),
                ({"outcome": "termed"}, stats.termed),
                ({"outcome": "nacked"}, stats.nacked),
            ],
        )
        _family(
            lines,
            "consumer_handler_errors",
            "counter",
            "Event-stream messages whose handler raised, by exception type; each was "
            "terminated and changed nothing",
            [
                ({"exception": kind}, count)
                for kind, count in sorted(stats.handler_error_types.items())
            ],
        )
        _family(
            lines,
            "consumer_max_deliveries",
            "counter",
            "Messages the server stopped delivering after max_deliver deliveries without an answer",
            [({}, stats.max_deliveries)],
        )
        _family(
            lines,
            "consumer_pull_requests",
            "counter",
            "Pull requests the manager's consumer sent",
            [({}, stats.requests)],
        )
        _family(
            lines,
            "consumer_watchdog",
            "counter",
            "Pull requests re-issued because neither messages nor heartbeats came",
            [({}, stats.watchdog)],
        )
    if sources.connected is not None:
        _family(
            lines,
            "connected",
            "gauge",
            "1 while the manager is connected, rebuilt and consuming",
            [({}, int(sources.connected()))],
        )
    if sources.failures is not None:
        _family(
            lines,
            "manager_session_failures",
            "counter",
            "Manager sessions that failed (connection, consumer) and were started again",
            [({}, sources.failures())],
        )
    if sources.rebuild_seconds is not None:
        seconds = sources.rebuild_seconds()
        if seconds is not None:
            _family(
                lines,
                "rebuild_seconds",
                "gauge",
                "How long the last rebuild of the registry took",
                [({}, float(seconds))],
            )
    if sources.tardis_calls is not None:
        _family(
            lines,
            "tardis_calls",
            "counter",
            "What the TARDIS integration did, by part and name (see docs/operations.md)",
            [
                ({"part": part, "call": call}, count)
                for part, counts in sorted(sources.tardis_calls().items())
                for call, count in sorted(dict(counts).items())
            ],
        )
    if sources.notes_buffered is not None:
        _family(
            lines,
            "tardis_notes_buffered",
            "gauge",
            "TARDIS state notes waiting to be published",
            [({}, sources.notes_buffered())],
        )
    return "\n".join(lines) + "\n"


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


class MetricsServer:
    """
    ``GET /metrics`` over HTTP, answered with :func:`render` of ``sources``

    :param host: address to bind (loopback unless the scraper is elsewhere)
    :param port: port to bind, ``0`` for a free one (see :attr:`port` once started)
    """

    def __init__(self, sources: Sources, host: str = "127.0.0.1", port: int = 9464) -> None:
        self.sources = sources
        self.host = host
        self.port = port
        self.scrapes = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """
        :raises BrokerError: if the address cannot be bound
        """
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as err:
            raise BrokerError(
                f"cannot serve metrics on {self.host}:{self.port}: {err.strerror or err}"
            ) from err
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLIENT_TIMEOUT_S)
            status, body, content_type = self._answer(head)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await asyncio.wait_for(writer.drain(), CLIENT_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a scraper that went away or never asked
        except Exception:  # never into the manager
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        text = "text/plain; charset=utf-8"
        if len(head) > _MAX_REQUEST:
            return "431 Request Header Fields Too Large", b"request too large\n", text
        method, _, rest = head.partition(b"\r\n")[0].decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method != "GET":
            return "405 Method Not Allowed", b"only GET\n", text
        if path != "/metrics":
            return "404 Not Found", b"metrics are at /metrics\n", text
        self.scrapes += 1
        return "200 OK", render(self.sources).encode(), CONTENT_TYPE
