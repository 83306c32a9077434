"""``cobald-remote drain / release / status``, run as separate processes"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from support.drones import FakeDrone, answer_commands, publish
from support.processes import CLI, run_process
from support.servers import drone_creds, secured_server

from broker.cli import main
from broker.commands.ops import EXIT_UNCONFIRMED
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.environment import site_of
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import Namespace

NS = Namespace()
SITE = "site1"


def test_site_of_tardis_uuids(capsys: pytest.CaptureFixture[str]) -> None:
    assert site_of("site1-0123456789") == "site1"
    assert site_of("my-site-0123456789") == "my-site"
    assert site_of("nodash") is None
    assert site_of("site1-not-a-uuid") is None
    assert main(["drain", "nodash", "--server", "nats://127.0.0.1:1"]) == 1
    assert "give --site" in capsys.readouterr().err


async def test_status_table_and_json(
    nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    busy = FakeDrone(SITE, "site1-00000000b1")
    before_busy = time.time()  # its facts are stored after this
    for event in (busy.started(), busy.ready(), busy.payload_started("1.0"), busy.heartbeat()):
        await publish(js, NS, event)
    await store.claim(SITE, busy.drone, busy.incarnation)
    idle = FakeDrone("site2", "site2-00000000c1")
    for event in (idle.started(), idle.ready(), idle.heartbeat()):
        await publish(js, NS, event)
    await store.release(SITE, "site1-00000000d1")
    done = FakeDrone(SITE, "site1-00000000e1")
    await publish(js, NS, done.started())
    await store.claim(SITE, done.drone, done.incarnation)
    await store.finish(SITE, done.drone, done.incarnation, ev.RecordPhase.DRAINED)
    await publish(js, NS, done.exiting())

    code, out, err = await run_process(*CLI, "status", "--server", nats_server.url)
    assert (code, err) == (
        0,
        "4 drones: 0 lost, 0 noisy, 1 ended (hidden; --ended shows them)\n",
    )
    lines = out.splitlines()
    assert lines[0].split() == [
        "DRONE",
        "SITE",
        "STATE",
        "PAYLOADS",
        "LAST",
        "FACT",
        "NOISY",
        "LOST/ENDED",
        "RECORD",
        "CLOCK",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert done.drone not in rows
    assert rows[busy.drone][1:4] == [SITE, "busy", "1"]
    assert rows[busy.drone][-3:-1] == ["-", "up"]
    # the fake drones' clocks stand in March: months behind the server's
    assert rows[busy.drone][-1].startswith("-") and rows[busy.drone][-1].endswith("d")
    assert rows[idle.drone][1:4] == ["site2", "idle", "0"]
    assert rows["site1-00000000d1"][1:4] == [SITE, "-", "0"]
    assert rows["site1-00000000d1"][-2:] == ["released", "-"]  # no heartbeat, no clock

    code, out, err = await run_process(*CLI, "status", "--ended", "--server", nats_server.url)
    ended = [line.split() for line in out.splitlines() if line.startswith(done.drone)]
    # its worker gone a second after its start, no payload, nobody asked: a black hole
    assert ended[0][-6:-1] == ["ended:", "drained,", "black", "hole", "drained"]
    assert err == "4 drones: 0 lost, 0 noisy, 1 ended\n"

    code, out, err = await run_process(
        *CLI, "status", busy.drone, "--json", "--server", nats_server.url
    )
    since_busy = time.time() - before_busy
    assert (code, err) == (0, "")
    (row,) = json.loads(out)
    assert row["drone"] == busy.drone and row["state"] == "busy"
    assert [p["job_id"] for p in row["payloads"]] == ["1.0"]
    assert row["lost"] is False and row["record_phase"] == "up" and row["seq"] == busy.seq
    assert row["noisy"] is False and row["noisy_at"] is None
    # the age of a fact stored since before_busy, as status saw it before it ended
    assert 0 <= row["last_fact_age_s"] <= since_busy

    code, out, err = await run_process(
        *CLI, "status", "--site", "site2", "--json", "--server", nats_server.url
    )
    assert code == 0 and [r["drone"] for r in json.loads(out)] == [idle.drone]

    code, out, err = await run_process(
        *CLI, "status", "site1-0000000404", "--server", nats_server.url
    )
    assert code == 1 and "no drone 'site1-0000000404'" in err


async def test_status_names_black_hole_drones_and_sites(
    nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    """Three drones of site3 end a second after their start, unasked: the site is flagged"""
    dead = [FakeDrone("site3", f"site3-00000000a{i}") for i in range(3)]
    for drone in dead:
        await publish(js, NS, drone.started())
        await store.claim("site3", drone.drone, drone.incarnation)
        await publish(js, NS, drone.worker_exited(1))
        await store.finish("site3", drone.drone, drone.incarnation, ev.RecordPhase.DRAINED)
        await publish(js, NS, drone.exiting())
    busy = FakeDrone(SITE, "site1-00000000b1")
    for event in (busy.started(), busy.ready(), busy.payload_started("1.0"), busy.heartbeat()):
        await publish(js, NS, event)

    code, out, err = await run_process(
        *CLI, "status", "--ended", "--json", "--server", nats_server.url
    )
    assert code == 0
    rows = {row["drone"]: row for row in json.loads(out)}
    assert [rows[d.drone]["black_hole"] for d in dead] == ["died"] * 3
    assert rows[busy.drone]["black_hole"] is None
    assert err == ""  # JSON alone
    code, out, err = await run_process(*CLI, "status", "--server", nats_server.url)
    assert err.splitlines() == [
        "4 drones: 0 lost, 0 noisy, 3 ended (hidden; --ended shows them)",
        "site site3 is a black hole: 3 drones in a row ended unasked, without a payload, "
        f"within 600s of their agent's start (the last {dead[-1].drone}), of the drones this "
        "rebuild reads",
    ]
    code, out, err = await run_process(*CLI, "status", "--site", SITE, "--server", nats_server.url)
    assert "black hole" not in err


async def test_release_and_drain(
    nats_server: EmbeddedServer, nc: Client, store: RecordStore
) -> None:
    url = nats_server.url
    # never heard of (no event, no record): a typo must not leave a record behind
    for command in ("release", "drain"):
        code, out, err = await run_process(*CLI, command, "site1-0000000001", "--server", url)
        assert (code, out) == (1, "")
        assert err == (
            "cobald-remote: site1/site1-0000000001: no event and no record of this drone: "
            f"check the uuid (cobald-remote status), or give --force to {command} it anyway\n"
        )
    assert await store.read(SITE, "site1-0000000001") is None
    code, out, err = await run_process(
        *CLI, "release", "site1-0000000001", "--force", "--server", url
    )
    assert code == 0 and "warning: site1/site1-0000000001: no event and no record" in err
    assert out.startswith("site1/site1-0000000001: released:")
    assert "may be removed" in out
    record = await store.read(SITE, "site1-0000000001")
    assert record is not None and record.record.phase is ev.RecordPhase.RELEASED

    code, out, err = await run_process(*CLI, "drain", "site1-0000000001", "--server", url)
    assert code == 0 and "drain released" in out

    # never announced: drain refuses and says what to do instead
    code, out, err = await run_process(
        *CLI, "drain", "site1-0000000002", "--force", "--server", url
    )
    assert code == 1 and "drain not_announced" in out and "release it instead" in out
    assert await store.read(SITE, "site1-0000000002") is None

    # announced, nobody answers: the intent is recorded, exit 3
    await store.claim(SITE, "site1-0000000003", "inc1")
    code, out, err = await run_process(*CLI,
        "drain", "site1-0000000003", "--deadline", "600", "--reason", "kernel update",
        "--timeout", "0.3", "--server", url,
    )  # fmt: skip
    assert code == EXIT_UNCONFIRMED and "drain unanswered" in out
    record = await store.read(SITE, "site1-0000000003")
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINING
    assert record.record.drain is not None and record.record.drain.reason == "kernel update"

    # announced, a (fake) agent answers
    drone = FakeDrone(SITE, "site1-0000000004")
    await store.claim(SITE, drone.drone, drone.incarnation)
    sub = await answer_commands(
        nc, NS, drone, lambda _c: (ev.Outcome.DRAIN_ACCEPTED, "gate closed")
    )
    try:
        code, out, err = await run_process(*CLI, "release", drone.drone, "--json", "--server", url)
    finally:
        await sub.unsubscribe()
    assert (code, err) == (0, "")
    result = json.loads(out)["result"]
    assert result["outcome"] == "draining"
    assert result["drain"]["outcome"] == "accepted"

    # an explicit site for a uuid that does not carry it
    code, out, err = await run_process(
        *CLI, "release", "odd_name", "--site", "siteX", "--force", "--server", url
    )
    assert code == 0 and out.startswith("siteX/odd_name: released")
    code, out, err = await run_process(*CLI, "release", "odd_name", "--server", url)
    assert code == 1 and "give --site" in err


async def test_unreachable_server_fails_fast() -> None:
    for command in (["status"], ["drain", "site1-0123456789"], ["release", "site1-0123456789"]):
        code, _, err = await run_process(*CLI, *command, "--server", "nats://127.0.0.1:1")
        assert code == 1 and "cannot connect" in err


async def test_a_refused_permission_or_credential_says_what_to_do(tmp_path: Path) -> None:
    drone = "site1-0123456789"
    async with secured_server(tmp_path) as (server, authority_file):
        creds = drone_creds(tmp_path, authority_file, SITE, drone)
        # a drone's credentials may not touch the records: one line, what to do
        code, out, err = await run_process(
            *CLI, "release", drone, "--creds", str(creds), "--server", server.url
        )
        assert (code, out) == (1, "")
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert "permissions violation" in err.lower()
        assert "need the manager's credentials" in err
        # no credentials at all: the server refuses the connection
        code, out, err = await run_process(*CLI, "drain", drone, "--server", server.url)
        assert (code, out) == (1, "")
        assert len(err.splitlines()) == 1 and "check --creds" in err


async def test_status_finds_a_drone_without_record_within_since(
    nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    # an agent that never claimed its record (another drone's credentials, no bucket)
    unclaimed = FakeDrone(SITE, "site1-00000000f1")
    await publish(js, NS, unclaimed.started())
    status = (*CLI, "status", "--server", nats_server.url, "--lost-after", "0.5")
    found: list[str] = []

    async def listed(*more: str) -> bool:
        code, out, err = await run_process(*status, *more)
        assert code == 0, err
        found[:] = [line.split()[0] for line in out.splitlines()[1:]]
        return unclaimed.drone in found

    assert await listed()  # it spoke within twice --lost-after
    code, _, err = await run_process(*status, unclaimed.drone)
    # one drone, in the singular; lost or not by now (--lost-after is half a second)
    assert code == 0 and re.fullmatch(r"1 drone: [01] lost, 0 noisy, 0 ended\n", err), err
    while await listed():  # until its event is older than that (a second here)
        pass
    assert await listed("--since", "3600")
    code, _, err = await run_process(*status, "--since", "-1")
    assert code == 1 and "--since must not be negative" in err
