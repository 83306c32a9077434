"""
Bootstrapped drones at a site's leaf node, with the issuer central (real servers in operator mode)

A drone at the leaf enrolls through the leaf and runs its whole life on its own JWT; with
that identity the leaf refuses whatever it would do for another drone, and the site's shared
bootstrap identity may do nothing there but ask the issuer and read its answers.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nats.errors
import pytest
from support.agent import SITE, drone_life, running
from support.agent import settings as agent_settings
from support.bootstrap import (
    DRONE,
    Asker,
    manager_settings,
    minted,
    refused,
    secured_hub_and_leaf,
    site_bootstrap,
    up,
    violations,
)
from support.manager import running_manager
from support.processes import CLI, start_process
from support.waiting import wait_until

from broker.server.auth.jwt import creds_file, decode_jwt
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import Issued, Refusal
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import (
    Namespace,
    bootstrap_inbox,
    direct_get,
    inbox_prefix,
    kv_write_prefix,
)

pytestmark = pytest.mark.timeout(180)
NS = Namespace()
OTHER = "site1-00000000bb"
#: the JetStream API of the hub's domain, as a drone at the leaf names it
API = "$JS.hub.API"
#: the life of each JWT the issuer signs in the revocation test: renewed at half of it
JWT_VALID_S = 3.0


def leaf_agent(tmp_path: Path, leaf: EmbeddedServer, token: str, bootstrap: Path) -> Agent:
    """A drone at the leaf with nothing but its token and the site's bootstrap identity"""
    return Agent(
        agent_settings(
            tmp_path,
            leaf.url,
            DRONE,
            domain="hub",
            bootstrap_token=token,
            bootstrap_creds=bootstrap,
        )
    )


def acting_for(drone: str) -> dict[str, list[str]]:
    """What a drone at the leaf would send or read to act for ``drone``"""
    return {
        "publish": [
            NS.event(SITE, drone, "drained"),
            kv_write_prefix(NS.record_bucket, "hub") + NS.record_key(SITE, drone),
        ],
        "subscribe": [NS.command(SITE, drone)],
    }


#: the grants bucket (token hashes, enrolled keys): for the manager's eyes only
GRANT = direct_get(NS.grant_bucket, NS.record_key(SITE, DRONE), "hub")


async def test_a_drone_at_a_leaf_runs_its_whole_life_on_its_own_bootstrapped_identity(
    tmp_path: Path,
) -> None:
    async with secured_hub_and_leaf(tmp_path) as (hub, leaf, authority):
        bootstrap = site_bootstrap(tmp_path, authority)
        async with running_manager(
            manager_settings(tmp_path, hub, authority, domain="hub")
        ) as service:
            agent = leaf_agent(tmp_path, leaf, await minted(service), bootstrap)
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
                # nor can it read grants or overhear the site's bootstrap replies
                await violations(
                    leaf.url,
                    own,
                    inbox_prefix(DRONE),
                    publish=[GRANT, kv_write_prefix(NS.grant_bucket, "hub") + "site1.x"],
                    subscribe=[f"{bootstrap_inbox(SITE)}.>"],
                )
                # the site's bootstrap identity: nothing but its requests and their replies
                await violations(
                    leaf.url,
                    bootstrap,
                    bootstrap_inbox(SITE),
                    publish=[
                        *acting_for(DRONE)["publish"],
                        NS.bootstrap("site2"),
                        f"{API}.STREAM.INFO.{NS.event_stream}",
                        GRANT,
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


async def test_a_revoked_drone_at_a_leaf_is_cut_off_there_once_its_jwt_expires(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewed through the leaf while granted; revoked by the command, the leaf shuts it out"""
    async with secured_hub_and_leaf(tmp_path) as (hub, leaf, authority):
        manager_creds = tmp_path / "manager.creds"
        settings = manager_settings(tmp_path, hub, authority, domain="hub", jwt_valid_s=JWT_VALID_S)
        bootstrap = site_bootstrap(tmp_path, authority)
        async with running_manager(settings) as service:
            agent = leaf_agent(tmp_path, leaf, await minted(service), bootstrap)
            with caplog.at_level(logging.INFO, "remote_agent"):
                async with running(agent) as run:
                    await wait_until(lambda: up(service.registry), 30, "the drone's events")
                    # it outlives its first JWTs: renewed through the leaf
                    await wait_until(
                        lambda: service.issuer_counts["issued_renew"] >= 3, 30, "renewals"
                    )
                    assert up(service.registry)
                    # the identity a thief of the drone's key could hold at the revocation
                    thief = Asker(leaf.url, bootstrap).with_seed_of(agent.settings.spool_dir)
                    issued = await thief.ask(thief.renew(DRONE))
                    assert isinstance(issued, Issued), issued
                    stolen = tmp_path / "stolen.creds"
                    seed: bytes = thief.key.seed
                    stolen.write_text(creds_file(issued.jwt, seed.decode()))
                    errors: list[str] = []

                    async def note(err: Exception) -> None:
                        errors.append(str(err))

                    held = await connect(
                        leaf.url,
                        user_credentials=str(stolen),
                        allow_reconnect=False,
                        error_cb=note,
                    )
                    cli = await start_process(
                        *CLI,
                        "auth",
                        "revoke-bootstrapped",
                        DRONE,
                        f"--server={hub.url}",
                        f"--creds={manager_creds}",
                        "--domain=hub",
                    )
                    assert await asyncio.wait_for(cli.wait(), 60) == 0
                    refused(await thief.ask(thief.renew(DRONE)), Refusal.REVOKED)
                    await wait_until(
                        lambda: service.issuer_counts["refused_revoked"] >= 2,
                        JWT_VALID_S * 2,
                        "the agent's renewal refused",
                    )
                    # cut off: the gate shut, the drone drained itself and exited
                    await wait_until(lambda: not agent.gate_open, 10, "the gate shut")
                    assert await run.exit_code(30) == 0
                    assert "revoked" in caplog.text
                    # the leaf closes a connection on that JWT at its expiry, and takes no new one
                    await wait_until(lambda: held.is_closed, JWT_VALID_S * 3, "the leaf closed it")
                    assert "expired" in str(held.last_error or errors), (held.last_error, errors)
                    await asyncio.sleep(1.5)  # a JWT's expiry is a whole second: past it
                    with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
                        await asyncio.wait_for(
                            connect(
                                leaf.url,
                                user_credentials=str(stolen),
                                allow_reconnect=False,
                                max_reconnect_attempts=0,
                            ),
                            30,
                        )
                    await close(held)
            view = service.registry.view(SITE, DRONE)
            assert view is not None and view.phase is ev.RecordPhase.DRAINED
