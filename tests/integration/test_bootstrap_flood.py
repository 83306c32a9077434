"""
A flood from one site's bootstrap identity, against a real nats-server in operator mode

A site's bootstrap credentials sit on every worker node of the site, so a payload can send
with them whatever one client can. What that may cost is its own site's requests (dropped
unread and counted); not another site's enrollments, not any drone's events, not the
issuer itself once the flood ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.agent import SITE, running
from support.agent import settings as agent_settings
from support.bootstrap import (
    DRONE,
    Asker,
    bootstrapped,
    flooding,
    issuer_threads,
    manager_settings,
    minted,
    site_bootstrap,
    up,
)
from support.manager import running_manager
from support.waiting import wait_until

from broker.manager.issuer import QUEUE_FULL
from broker.manager.service import ManagerService
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import Issued, IssueRefused

pytestmark = pytest.mark.timeout(180)
OTHER_SITE = "site2"
#: a drone of the other site that runs through the flood, its heartbeats watched
WATCHED = "site2-0000ffffff"


def heartbeats(service: ManagerService) -> int:
    view = service.registry.view(OTHER_SITE, WATCHED)
    return -1 if view is None or view.seq is None else view.seq


async def test_a_flood_from_one_site_holds_up_neither_another_site_nor_any_drone_s_events(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    flooded_creds = site_bootstrap(tmp_path, authority)
    other_creds = site_bootstrap(tmp_path, authority, OTHER_SITE)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        assert len(issuer_threads()) == 1
        token = await minted(service)  # the flooded site has a drone of its own
        tokens = {
            f"site2-00000000{i:02x}": await minted(service, f"site2-00000000{i:02x}", OTHER_SITE)
            for i in range(8)
        }
        watched = Agent(
            agent_settings(
                tmp_path,
                server.url,
                WATCHED,
                site=OTHER_SITE,
                heartbeat_s=0.1,
                bootstrap_token=await minted(service, WATCHED, OTHER_SITE),
                bootstrap_creds=other_creds,
            )
        )
        async with running(watched):
            await wait_until(lambda: up(service.registry, WATCHED, OTHER_SITE), 30, "site2 up")
            # what the flood sends: a well-formed enrollment, signed, with a wrong token
            guess = Asker(server.url, flooded_creds).with_key(3)
            body = ev.encode(guess.enroll(DRONE, "not-the-token"))
            async with flooding(server.url, flooded_creds, body) as flood:
                dropped = f"{QUEUE_FULL}{SITE}"
                await wait_until(
                    lambda: service.issuer_counts[dropped] > 0, 30, "site1's requests dropped"
                )
                seen = heartbeats(service)
                # one request each, with as long as an agent waits for its answer
                # (remote_agent/agent/identity.py)
                answers: list[Issued | IssueRefused] = []
                for number, (drone, minted_token) in enumerate(tokens.items()):
                    asker = Asker(server.url, other_creds, OTHER_SITE).with_key(10 + number)
                    answers.append(
                        await asker.ask(asker.enroll(drone, minted_token), timeout_s=5.0)
                    )
                await wait_until(
                    lambda: heartbeats(service) >= seen + 10, 30, "site2's heartbeats applied"
                )
                so_far = service.issuer_counts[dropped]
                await wait_until(
                    lambda: service.issuer_counts[dropped] > so_far, 30, "still flooding"
                )
                assert flood.returncode is None
            assert all(isinstance(answer, Issued) for answer in answers), answers
            # the flood's requests that were read at all were refused: the token is unused
            assert service.issuer is not None
            grant = await service.issuer.grants.get(SITE, DRONE)
            assert grant is not None and grant[0].public_key is None
            # once it ends, the flooded site's own drone enrolls (asking again as agents do)
            async with running(bootstrapped(tmp_path, server, authority, token)):
                await wait_until(lambda: up(service.registry), 120, "site1's own drone up")
    assert not issuer_threads()  # stopped with the manager
