"""
Bootstrapped drones at a site's leaf node, with the issuer central (real servers in operator mode)

A drone at the leaf enrolls through the leaf and runs its whole life on its own JWT; with
that identity the leaf refuses whatever it would do for another drone, and the site's shared
bootstrap identity may do nothing there but ask the issuer and read its answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.agent import SITE, drone_life
from support.agent import settings as agent_settings
from support.bootstrap import (
    DRONE,
    Asker,
    minted,
    secured_hub_and_leaf,
    site_bootstrap,
    violations,
)
from support.manager import running_manager

from broker.manager.issuer import IssuerSettings
from broker.manager.service import ManagerSettings
from broker.server.auth.jwt import creds_file, decode_jwt
from remote_agent.agent import Agent
from remote_agent.protocol.bootstrap import Issued
from remote_agent.protocol.names import Namespace, bootstrap_inbox, inbox_prefix

pytestmark = pytest.mark.timeout(180)
NS = Namespace()
OTHER = "site1-00000000bb"
#: the JetStream API of the hub's domain, as a drone at the leaf names it
API = "$JS.hub.API"


def acting_for(drone: str) -> dict[str, list[str]]:
    """What a drone at the leaf would send or read to act for ``drone``"""
    return {
        "publish": [
            NS.event(SITE, drone, "drained"),
            f"{API}.$KV.{NS.record_bucket}.{SITE}.{drone}",
        ],
        "subscribe": [NS.command(SITE, drone)],
    }


async def test_a_drone_at_a_leaf_runs_its_whole_life_on_its_own_bootstrapped_identity(
    tmp_path: Path,
) -> None:
    async with secured_hub_and_leaf(tmp_path) as (hub, leaf, authority):
        settings = ManagerSettings(
            servers=[hub.url],
            creds=str(tmp_path / "manager.creds"),
            domain="hub",
            retry_s=0.2,
            issuer=IssuerSettings(authority=authority),
        )
        bootstrap = site_bootstrap(tmp_path, authority)
        async with running_manager(settings) as service:
            token = await minted(service)
            agent = Agent(
                agent_settings(
                    tmp_path,
                    leaf.url,
                    DRONE,
                    domain="hub",
                    bootstrap_token=token,
                    bootstrap_creds=bootstrap,
                )
            )
            assert agent.settings.creds is None  # nothing but the token and the site's identity

            async def refused_at_the_leaf() -> None:
                # the drone's own identity: its own key (made on the drone) and a JWT for it
                asker = Asker(leaf.url, bootstrap).with_seed_of(agent.settings.spool_dir)
                issued = await asker.ask(asker.renew(DRONE))
                assert isinstance(issued, Issued), issued
                assert decode_jwt(issued.jwt)["sub"] == asker.public
                own = tmp_path / "own.creds"
                seed: bytes = asker.key.seed
                own.write_text(creds_file(issued.jwt, seed.decode()))
                await violations(leaf.url, own, inbox_prefix(DRONE), **acting_for(OTHER))
                # the site's bootstrap identity: nothing but its requests and their replies
                await violations(
                    leaf.url,
                    bootstrap,
                    bootstrap_inbox(SITE),
                    publish=[
                        *acting_for(DRONE)["publish"],
                        NS.bootstrap("site2"),
                        f"{API}.STREAM.INFO.{NS.event_stream}",
                    ],
                    subscribe=[
                        NS.bootstrap(SITE),  # the other drones' requests, with their tokens
                        NS.command(SITE, DRONE),
                        f"{inbox_prefix(DRONE)}.>",
                    ],
                )

            await drone_life(
                service, agent, while_up=refused_at_the_leaf, reason="leaf bootstrap test"
            )
            assert service.registry.view(SITE, OTHER) is None
            assert service.registry.metrics().rejected_total == 0
            assert service.issuer_counts["issued_enroll"] == 1
            assert not any(key.startswith("refused_") for key in service.issuer_counts)
