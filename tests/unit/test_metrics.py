"""Prometheus metrics: the text (read back by prometheus_client's parser) and the endpoint"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.drones import FakeDrone

from broker.jetstream.messages import ConsumerStats
from broker.manager import metrics as metrics_module
from broker.manager.metrics import MetricsServer, Sources, parse_address, render
from broker.manager.registry import Registry
from broker.tardis_adapter import BusConfig
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import Namespace

NS = Namespace()
SITE = "site1"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, labels), parsed the way Prometheus does"""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _apply(
    registry: Registry, drone: FakeDrone, event: ev.Event, at: float, stream_seq: int
) -> None:
    registry.apply_message(ev.encode(event), drone.subject(event, NS), at, stream_seq)


def _fleet(registry: Registry, now: float) -> None:
    idle = FakeDrone(SITE, "site1-0000000001")
    busy = FakeDrone(SITE, "site1-0000000002")
    silent = FakeDrone(SITE, "site1-0000000003")
    for number, event in enumerate((idle.started(), idle.ready()), 1):
        _apply(registry, idle, event, now, number)
    started = busy.started()
    for number, event in enumerate((started, busy.ready(), busy.payload_started("7.0")), 3):
        _apply(registry, busy, event, now, number)
    _apply(registry, busy, started, now, 3)  # delivered again: stale
    beat = busy.heartbeat()
    _apply(registry, busy, beat, now, 6)
    _apply(registry, busy, beat, now, 6)  # delivered twice: duplicate
    _apply(registry, silent, silent.started(), now - 3600, 7)  # lost long ago
    registry.apply_message(b"\xc1", NS.event(SITE, "site1-0000000004", "heartbeat"), now)
    record = ev.DroneRecord(
        site=SITE,
        drone="site1-0000000005",
        phase=ev.RecordPhase.RELEASED,
        writer="manager",
        at=ev.utcnow(),
    )
    registry.apply_record(record, 3, now)


def test_render_is_valid_exposition_with_the_registry_counts() -> None:
    now = time.time()
    registry = Registry(NS)
    _fleet(registry, now)
    stats = ConsumerStats(
        acked=6,
        termed=3,
        handler_errors=2,
        handler_error_types={"RecursionError": 1, "ValueError": 1},
        max_deliveries=4,
        requests=2,
        watchdog=1,
    )
    counts = {"bus": collections.Counter(notes_published=4), "site:Site1": {"drain_accepted": 2}}
    text = render(
        Sources(
            registry=registry,
            consumer=stats,
            connected=lambda: True,
            failures=lambda: 3,
            rebuild_seconds=lambda: 0.25,
            tardis_calls=lambda: counts,
            notes_buffered=lambda: 5,
        ),
        now=now,
    )
    samples = _samples(text)
    metrics = registry.metrics()

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("cobald_remote_registry_events_total", outcome="applied") == metrics.applied == 7
    assert value("cobald_remote_registry_events_total", outcome="duplicate") == 1
    assert value("cobald_remote_registry_events_total", outcome="stale") == 1
    assert value("cobald_remote_registry_rejected_total", reason="malformed") == 1
    assert value("cobald_remote_registry_rejected_total", reason="sender") == 0
    assert value("cobald_remote_registry_records_total", outcome="applied") == 1
    assert value("cobald_remote_drones", state="idle") == 1
    assert value("cobald_remote_drones", state="busy") == 1
    assert value("cobald_remote_drones", state="starting") == 1
    assert value("cobald_remote_drones", state="unknown") == 1  # only a record
    assert value("cobald_remote_drones", state="draining") == 0  # every state listed
    assert value("cobald_remote_drone_records", phase="released") == 1
    assert value("cobald_remote_drone_records", phase="none") == 3
    assert value("cobald_remote_drones_lost") == 1
    assert value("cobald_remote_consumer_messages_total", outcome="acked") == 6
    assert value("cobald_remote_consumer_messages_total", outcome="termed") == 3
    assert ("cobald_remote_consumer_messages_total", (("outcome", "failed"),)) not in samples
    errors = "cobald_remote_consumer_handler_errors_total"
    assert value(errors, exception="RecursionError") == value(errors, exception="ValueError") == 1
    assert value("cobald_remote_consumer_max_deliveries_total") == 4
    assert value("cobald_remote_consumer_pull_requests_total") == 2
    assert value("cobald_remote_consumer_watchdog_total") == 1
    assert value("cobald_remote_connected") == 1
    assert value("cobald_remote_manager_session_failures_total") == 3
    assert value("cobald_remote_rebuild_seconds") == 0.25
    assert value("cobald_remote_tardis_calls_total", part="bus", call="notes_published") == 4
    assert value("cobald_remote_tardis_calls_total", part="site:Site1", call="drain_accepted") == 2
    assert value("cobald_remote_tardis_notes_buffered") == 5
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families["cobald_remote_registry_events"] == "counter"
    assert families["cobald_remote_drones"] == "gauge"


def test_render_with_only_a_registry_names_no_other_family() -> None:
    text = render(Sources(registry=Registry(NS)))
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names == {
        "cobald_remote_registry_events",
        "cobald_remote_registry_rejected",
        "cobald_remote_registry_records",
        "cobald_remote_drones",
        "cobald_remote_drone_records",
        "cobald_remote_drones_lost",
    }


def test_label_values_are_escaped() -> None:
    counts = {"bus": {'odd "name"\\with\nnewline': 1}}
    text = render(Sources(registry=Registry(NS), tardis_calls=lambda: counts))
    assert (
        _samples(text)[
            (
                "cobald_remote_tardis_calls_total",
                (("call", 'odd "name"\\with\nnewline'), ("part", "bus")),
            )
        ]
        == 1
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:9100", ("::1", 9100)),
        ("9464", ("127.0.0.1", 9464)),
        ("metrics.example.org:80", ("metrics.example.org", 80)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host", ":9464", "host:port", "host:70000", "host:-1"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="metrics"):
        parse_address(text)


def test_bus_config_checks_the_metrics_address() -> None:
    config = BusConfig.from_mapping({"servers": "nats://a:4222", "metrics": "127.0.0.1:9464"})
    assert config.metrics_address == ("127.0.0.1", 9464)
    assert BusConfig.from_mapping({"servers": "nats://a:4222"}).metrics_address is None
    with pytest.raises(ValueError, match="not host:port"):
        BusConfig.from_mapping({"servers": "nats://a:4222", "metrics": "nowhere"})


async def _request(port: int, raw: bytes) -> tuple[str, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status, headers, body


async def test_endpoint_serves_metrics_and_nothing_else() -> None:
    registry = Registry(NS)
    _fleet(registry, time.time())
    server = MetricsServer(Sources(registry=registry), "127.0.0.1", 0)
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    try:
        for _ in range(100):
            if server.port:
                break
            await asyncio.sleep(0.01)
        status, headers, body = await _request(
            server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert status == "HTTP/1.1 200 OK"
        assert headers["content-type"] == metrics_module.CONTENT_TYPE
        assert int(headers["content-length"]) == len(body)
        assert _samples(body.decode())[("cobald_remote_drones", (("state", "busy"),))] == 1
        assert (await _request(server.port, b"GET / HTTP/1.1\r\n\r\n"))[0].startswith(
            "HTTP/1.1 404"
        )
        assert (await _request(server.port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0].startswith(
            "HTTP/1.1 405"
        )
        # a client that connects and sends nothing is cut off; the server goes on
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        status, _, _ = await _request(server.port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert status == "HTTP/1.1 200 OK"
        writer.close()
        assert server.scrapes == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_silent_client_is_disconnected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "CLIENT_TIMEOUT_S", 0.2)
    server = MetricsServer(Sources(registry=Registry(NS)), "127.0.0.1", 0)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        writer.close()
    finally:
        await server.close()


async def test_an_address_in_use_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    first = MetricsServer(Sources(registry=Registry(NS)), "127.0.0.1", 0)
    await first.start()
    try:
        second = MetricsServer(Sources(registry=Registry(NS)), "127.0.0.1", first.port)
        await asyncio.wait_for(second.run(asyncio.Event()), 10)  # returns at once
        assert "cannot serve metrics on 127.0.0.1" in caplog.text
    finally:
        await first.close()
