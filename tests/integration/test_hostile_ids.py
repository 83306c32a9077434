"""
A drone that takes another drone's event ids first, with its own credentials

The stream drops a second message with an id it holds, whoever published the first: a
drone that learned another's incarnation can publish, on its own subject, under that
drone's next ids. The victim's agent must not take the answer ``duplicate`` for "stored".
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.agent import read_events, running
from support.agent import settings as agent_settings
from support.hostile import DRONE, NS, OTHER, SITE, as_drone, manager
from support.servers import drone_creds
from support.waiting import wait_until

from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import MSG_ID, dedupe_id

pytestmark = pytest.mark.timeout(120)

#: the victim's next ids the attacker takes
TAKEN = 4


async def test_ids_taken_by_another_drone_lose_no_event(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    attacker = drone_creds(tmp_path, authority, SITE, DRONE)
    victim = Agent(
        agent_settings(
            tmp_path, server.url, OTHER, creds=drone_creds(tmp_path, authority, SITE, OTHER)
        )
    )
    async with (
        manager(server.url, tmp_path / "manager.creds") as service,
        running(victim) as run,
    ):
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, OTHER)) is not None
                and view.phase is ev.RecordPhase.UP
                and view.state is ev.DroneState.IDLE
            ),
            60,
            "the victim claimed and idle at the manager",
        )
        publisher = victim.publisher
        assert publisher is not None
        await wait_until(lambda: not len(publisher.spool), what="the victim's spool empty")
        last = victim.emitter.seq
        async with as_drone(server.url, attacker) as nc:
            js = nc.jetstream()
            for seq in range(last + 1, last + 1 + TAKEN):
                ack = await js.publish(
                    NS.event(SITE, DRONE, "heartbeat"),
                    b"not even an event",
                    headers={MSG_ID: dedupe_id(OTHER, victim.incarnation, seq)},
                )
                assert not ack.duplicate  # the stream holds the victim's next ids now
        assert service.control is not None
        drained = await service.control.drain(SITE, OTHER, reason="ids taken")
        assert drained.outcome in ("accepted", "drained"), drained
        assert await run.exit_code(60) == 0
        reader = await connect(server.url, user_credentials=str(tmp_path / "manager.creds"))
        try:
            stored = await read_events(reader.jetstream(), OTHER)
        finally:
            await close(reader)
        seqs = [event.seq for _, event in stored]
        # the manager applies the victim's last word, the one its agent sent
        await wait_until(
            lambda: (
                (view := service.registry.view(SITE, OTHER)) is not None and view.seq == seqs[-1]
            ),
            what="the victim's last event at the manager",
        )
        assert service.registry.metrics().rejected_total >= TAKEN  # the attacker's bodies
    assert seqs == list(range(seqs[0], seqs[-1] + 1)), "every event of the victim was stored"
    assert publisher.taken >= TAKEN
    assert seqs[-1] > last + TAKEN
    renamed = [(msg_id, event) for msg_id, event in stored if last < event.seq <= last + TAKEN]
    assert len(renamed) == TAKEN
    for msg_id, event in renamed:
        plain = dedupe_id(OTHER, victim.incarnation, event.seq)
        assert msg_id == event.id and event.id.startswith(f"{plain}:")
        assert len(event.id) == len(plain) + 17  # ":" and 16 hex digits nobody can guess
