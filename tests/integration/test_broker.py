"""The embedded broker and provisioning, against a real nats-server"""

from __future__ import annotations

import os
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from support.processes import pid_exists
from support.vectors import EXAMPLES, example

from broker.errors import ProvisioningError, ServerStartError
from broker.server.embedded import EmbeddedServer
from broker.server.provision import Topology, provision
from remote_agent.protocol import events as ev
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import Namespace

NS = Namespace()


def _events() -> list[ev.Event]:
    return [m for m in EXAMPLES if isinstance(m, ev.Event)]


async def _publish_all(js: JetStreamContext) -> None:
    for event in _events():
        subject = NS.event(event.site, event.drone, ev.kind_of(type(event)))
        await js.publish(subject, ev.encode(event), headers={"Nats-Msg-Id": event.id})


async def _read_all(js: JetStreamContext) -> list[ev.AnyEvent]:
    info = await js.stream_info(NS.event_stream)
    return [
        ev.decode_event((await js.get_msg(NS.event_stream, seq)).data or b"")
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]


async def test_server_binds_loopback_on_a_random_port(nats_server: EmbeddedServer) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    assert not nats_server.url.endswith(":4222")
    assert nats_server.pid is not None and pid_exists(nats_server.pid)


async def test_stream_data_survives_stop_and_start(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "store")
    url = await server.start()
    first_pid = server.pid
    nc = await nats.connect(url)
    await provision(nc.jetstream())
    await _publish_all(nc.jetstream())
    await nc.close()
    await server.stop()
    assert not pid_exists(first_pid)

    second = EmbeddedServer(tmp_path / "store")
    url = await second.start()
    try:
        nc = await nats.connect(url)
        js = nc.jetstream()
        assert await _read_all(js) == _events()
        # the dedupe window survived too: a resend is recognised
        event = _events()[0]
        ack = await js.publish(
            NS.event(event.site, event.drone, ev.kind_of(type(event))),
            ev.encode(event),
            headers={"Nats-Msg-Id": event.id},
        )
        assert ack.duplicate
        assert await provision(js) == {
            NS.event_stream: "unchanged",
            f"KV_{NS.record_bucket}": "unchanged",
            f"KV_{NS.manager_bucket}": "unchanged",
            f"KV_{NS.grant_bucket}": "unchanged",
        }
        await nc.close()
    finally:
        await second.stop()


async def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, binary=tmp_path / "no-such-nats-server")
    with pytest.raises(ServerStartError, match="is not an executable"):
        await server.start()


async def test_binary_not_found_names_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.server import embedded as server_module

    monkeypatch.setattr(server_module.sysconfig, "get_path", lambda _name: str(tmp_path))
    monkeypatch.setattr(server_module.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("COBALD_REMOTE_NATS_SERVER", raising=False)
    with pytest.raises(
        ServerStartError, match=r"install the manager side .*cobald-remote\[manager\]"
    ):
        server_module.find_binary()


async def test_unwritable_store_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ServerStartError, match=r"store directory .* is not writable"):
        await EmbeddedServer(blocker / "store").start()


async def test_server_that_dies_during_start_is_reported(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, extra_args=["--no-such-flag"])
    with pytest.raises(ServerStartError, match="exited with status"):
        await server.start()


async def test_restart_keeps_url(nats_server: EmbeddedServer) -> None:
    url = nats_server.url
    assert await nats_server.restart() == url


async def test_provisioning_twice_changes_nothing(js: JetStreamContext) -> None:
    first = await provision(js)
    assert set(first.values()) == {"created"}
    before = {name: await js.stream_info(name) for name in first}
    assert set((await provision(js)).values()) == {"unchanged"}
    for name, info in before.items():
        after = await js.stream_info(name)
        assert after.created == info.created
        assert after.config == info.config


async def test_provisioning_updates_what_changed(js: JetStreamContext) -> None:
    await provision(js)
    changed = await provision(js, Topology(event_max_age_s=3600, duplicate_window_s=60))
    assert changed == {
        NS.event_stream: "updated",
        f"KV_{NS.record_bucket}": "unchanged",
        f"KV_{NS.manager_bucket}": "unchanged",
        f"KV_{NS.grant_bucket}": "unchanged",
    }
    info = await js.stream_info(NS.event_stream)
    assert info.config.max_age == 3600
    assert info.config.duplicate_window == 60


async def test_kv_bucket_is_usable_with_compare_and_set(js: JetStreamContext) -> None:
    await provision(js)
    kv = await js.key_value(NS.record_bucket)
    record = example(ev.DroneRecord)
    assert isinstance(record, ev.DroneRecord)
    key = NS.record_key(record.site, record.drone)
    revision = await kv.create(key, ev.encode(record))
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await kv.create(key, ev.encode(record))
    await kv.update(key, ev.encode(record), last=revision)
    entry = await kv.get(key)
    assert ev.decode_record(entry.value or b"") == record


async def test_overlapping_stream_is_a_clear_conflict(js: JetStreamContext) -> None:
    await js.add_stream(StreamConfig(name="SOMEONE_ELSE", subjects=["cobald.site1.>"]))
    with pytest.raises(ProvisioningError, match="overlap with another stream") as info:
        await provision(js)
    assert info.value.name == NS.event_stream
    assert "SOMEONE_ELSE" in {s.config.name for s in await js.streams_info()}


async def test_immutable_difference_is_a_clear_conflict(js: JetStreamContext) -> None:
    wanted = Topology().event_stream()
    wanted.storage = StorageType.MEMORY
    await js.add_stream(wanted)
    with pytest.raises(ProvisioningError, match="differs in storage and the server refused"):
        await provision(js)


async def test_server_without_jetstream_is_a_clear_error(tmp_path: Path) -> None:
    async with EmbeddedServer(tmp_path, jetstream=False) as server:
        nc = await nats.connect(server.url)
        try:
            with pytest.raises(ProvisioningError, match="has no JetStream"):
                await provision(nc.jetstream(timeout=1))
        finally:
            await nc.close()


async def test_streams_refuse_oversized_messages(js: JetStreamContext, nc: Client) -> None:
    await provision(js)
    with pytest.raises(nats.js.errors.APIError, match="message size exceeds maximum"):
        await js.publish(NS.event("s", "d", "heartbeat"), os.urandom(DEFAULT_MAX_SIZE + 1))


async def test_sync_always_fsyncs_every_write_and_keeps_data(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "store", sync_always=True)
    async with server:
        nc = await nats.connect(server.url)
        await provision(nc.jetstream())
        await _publish_all(nc.jetstream())
        await nc.close()
    assert "sync_interval: always" in (tmp_path / "store" / "run" / "jetstream.conf").read_text()
    async with EmbeddedServer(tmp_path / "store", sync_always=True) as again:
        nc = await nats.connect(again.url)
        assert await _read_all(nc.jetstream()) == _events()
        await nc.close()
