"""The cobald-remote command line, run as a separate process"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import nats
import pytest
from support import bootstrap_vectors
from support.processes import CLI, pid_exists, run_process, start_process
from support.vectors import EXAMPLES, example

from remote_agent.protocol import events as ev


async def test_protocol_decode_prints_json() -> None:
    message = example(ev.DroneRecord)
    code, out, err = await run_process(*CLI, "protocol", "decode", input=ev.encode(message))
    assert (code, err) == (0, "")
    assert out.strip().encode() == ev.to_json(message)


@pytest.mark.parametrize("message", bootstrap_vectors.EXAMPLES, ids=lambda m: ev.kind_of(type(m)))
async def test_protocol_decode_takes_the_bootstrap_messages(message: ev.Message) -> None:
    code, out, err = await run_process(*CLI, "protocol", "decode", input=ev.encode(message))
    assert (code, err) == (0, "")
    assert out.strip().encode() == ev.to_json(message)


async def test_protocol_decode_rejects_garbage() -> None:
    code, out, err = await run_process(*CLI, "protocol", "decode", input=b"\x81\xa4kind\xa3foo")
    assert (code, out) == (1, "")
    assert err == "cobald-remote: invalid message: Invalid value 'foo' - at `$.kind`\n"
    code, _, err = await run_process(
        *CLI, "protocol", "decode", "--max-size", "8", input=ev.encode(EXAMPLES[0])
    )
    assert code == 1
    assert "exceeds the limit of 8 bytes" in err


async def test_broker_serve_and_init(tmp_path: Path) -> None:
    proc = await start_process(
        *CLI,
        "broker",
        "serve",
        "--store",
        str(tmp_path / "store"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        assert url.startswith("nats://127.0.0.1:")
        banner = (await proc.stderr.readline()).decode()
        server_pid = int(banner.split("pid ")[1].split()[0])

        nc = await nats.connect(url)
        names = {info.config.name for info in await nc.jetstream().streams_info()}
        await nc.close()
        assert names == {
            "COBALD_EVENTS",
            "KV_cobald-drones",
            "KV_cobald-manager",
            "KV_cobald-grants",
        }

        code, out, err = await run_process(*CLI, "broker", "init", "--server", url)
        assert (code, err) == (0, "")
        assert out.splitlines() == [
            "COBALD_EVENTS: unchanged",
            "KV_cobald-drones: unchanged",
            "KV_cobald-manager: unchanged",
            "KV_cobald-grants: unchanged",
        ]
    finally:
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    assert not pid_exists(server_pid)


async def test_broker_init_without_server_fails_fast() -> None:
    code, out, err = await run_process(*CLI, "broker", "init", "--server", "nats://127.0.0.1:1")
    assert (code, out) == (1, "")
    assert err.startswith("cobald-remote: cannot connect to nats://127.0.0.1:1")


async def test_broker_serve_reports_missing_binary(tmp_path: Path) -> None:
    code, _, err = await run_process(
        *CLI, "broker", "serve", "--store", str(tmp_path), "--nats-server", os.devnull + "x"
    )
    assert code == 1
    assert "is not an executable" in err
