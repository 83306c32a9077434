"""Prometheus metrics: the address setting and the endpoint that serves the text"""

from __future__ import annotations

import asyncio
import time

import pytest
from support.metrics import NS, SITE, fleet, parsed

from broker.manager import metrics as metrics_module
from broker.manager.metrics import MetricsServer, Sources, parse_address
from broker.manager.registry import Registry
from broker.tardis_adapter import BusConfig


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
    fleet(registry, time.time())
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
        assert status.split()[1] == "200"
        assert headers["content-type"] == metrics_module.CONTENT_TYPE
        assert int(headers["content-length"]) == len(body)
        busy = (("site", SITE), ("state", "busy"))
        assert parsed(body.decode())[("cobald_remote_drones", busy)] == 1
        assert (await _request(server.port, b"GET / HTTP/1.1\r\n\r\n"))[0].split()[1] == "404"
        status = (await _request(server.port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0]
        assert status.split()[1] == "405"
        # a client that connects and sends nothing is cut off; the server goes on
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        status, _, _ = await _request(server.port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert status.split()[1] == "200"
        writer.close()
        assert server.scrapes == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_silent_client_is_disconnected() -> None:
    server = MetricsServer(Sources(registry=Registry(NS)), "127.0.0.1", 0, client_timeout_s=0.2)
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


async def test_a_failing_source_fails_its_scrape_not_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = True

    def notes() -> int:
        if broken:
            raise RuntimeError("boom")
        return 7

    server = MetricsServer(Sources(registry=Registry(NS), notes_buffered=notes), "127.0.0.1", 0)
    await server.start()
    try:
        status, _, _ = await _request(server.port, b"GET /metrics HTTP/1.0\r\n\r\n")
        assert status.split()[1] == "500"
        assert "metrics scrape failed: RuntimeError: boom" in caplog.text
        broken = False
        status, _, body = await _request(server.port, b"GET /metrics HTTP/1.0\r\n\r\n")
        assert status.split()[1] == "200"
        assert parsed(body.decode())[("cobald_remote_tardis_notes_buffered", ())] == 7
    finally:
        await server.close()


async def test_two_managers_in_one_process_serve_their_own_numbers() -> None:
    servers = [
        MetricsServer(Sources(registry=Registry(NS), notes_buffered=lambda n=n: n), "127.0.0.1", 0)
        for n in (1, 2)
    ]
    for server in servers:
        await server.start()
    try:
        for n, server in enumerate(servers, 1):
            _, _, body = await _request(server.port, b"GET /metrics HTTP/1.0\r\n\r\n")
            assert parsed(body.decode())[("cobald_remote_tardis_notes_buffered", ())] == n
    finally:
        for server in servers:
            await server.close()
