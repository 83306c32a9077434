"""
Bootstrapped drone identities against a real nats-server in operator mode

A drone gets a one-time token, makes its own key, trades the token for a JWT over the
site's bootstrap identity and runs on that JWT; the issuer refuses whatever would give
anyone else an identity, and a refused or stolen bootstrap is visible and harmless.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from pathlib import Path

import nats.errors
import pytest
from support.agent import SITE, drone_life, running
from support.agent import settings as agent_settings
from support.bootstrap import (
    Asker,
    bootstrapped,
    issuer_threads,
    manager_settings,
    minted,
    refused,
    site_bootstrap,
    up,
)
from support.manager import running_manager
from support.servers import refused_for_another
from support.waiting import wait_until

from broker.server.auth.jwt import creds_file, decode_jwt
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import EnrollRequest, Issued, Refusal
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace, bootstrap_inbox

pytestmark = pytest.mark.timeout(120)
NS = Namespace()
DRONE = "site1-00000000aa"
OTHER = "site1-00000000bb"


async def test_a_bootstrapped_drone_runs_its_whole_life_on_its_own_identity(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    settings = manager_settings(tmp_path, server, authority)
    async with running_manager(settings) as service:
        agent = bootstrapped(tmp_path, server, authority, await minted(service))

        async def refused_with_its_identity() -> None:
            # the drone's own JWT and seed, as a thief on the drone would take them
            publisher = agent.emitter.publisher
            assert publisher is not None and publisher.identity is not None
            seed = (tmp_path / f"spool-{DRONE}" / "identity.seed").read_text().strip()
            creds = tmp_path / "taken.creds"
            creds.write_text(creds_file(publisher.identity.user_jwt().decode(), seed))
            await refused_for_another(server.url, creds, DRONE, OTHER)

        await drone_life(
            service, agent, while_up=refused_with_its_identity, reason="bootstrap test"
        )
        assert service.registry.view(SITE, OTHER) is None
        assert service.issuer_counts["issued_enroll"] == 1
        seed = (tmp_path / f"spool-{DRONE}" / "identity.seed").stat()
        assert seed.st_mode & 0o777 == 0o600


async def test_the_token_gives_one_identity_to_one_key_only(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Used twice (by another key), for another drone, forged, or from another site"""
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        other_token = await minted(service, OTHER)
        thief, owner = Asker(server.url, creds).with_key(1), Asker(server.url, creds).with_key(2)
        first = await thief.ask(thief.enroll(DRONE, token))
        assert isinstance(first, Issued)
        assert decode_jwt(first.jwt)["sub"] == thief.public
        # the same key again: the same identity (an agent restarted with its key)
        assert isinstance(await thief.ask(thief.enroll(DRONE, token)), Issued)
        with caplog.at_level(logging.ERROR, "cobald.runtime.cobald_remote.issuer"):
            refused(await owner.ask(owner.enroll(DRONE, token)), Refusal.REUSED)
        assert "ALARM" in caplog.text and DRONE in caplog.text
        assert service.issuer_counts["alarms"] == 1
        # another drone's token, a made-up one, a renewal with a key it never enrolled
        refused(await owner.ask(owner.enroll(OTHER, token)), Refusal.FORGED)
        refused(await owner.ask(owner.enroll(OTHER, "x" * 43)), Refusal.FORGED)
        refused(await owner.ask(owner.renew(DRONE)), Refusal.FORGED)
        refused(await owner.ask(owner.enroll("site1-00000000cc", other_token)), Refusal.UNKNOWN)
        # a signature over something else, garbage
        good = owner.enroll(OTHER, other_token)
        forged = EnrollRequest(
            site=SITE,
            drone=OTHER,
            public_key=thief.public,
            at=good.at,
            signature=good.signature,
            token=other_token,
        )
        refused(await owner.ask(forged), Refusal.FORGED)
        refused(await owner.ask(b"\x93garbage"), Refusal.MALFORMED)
        # signed by a clock an hour behind: answered (a JWT for the signer's key only),
        # counted and said; the same key again gets the same answer
        old = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
        assert isinstance(await owner.ask(owner.enroll(OTHER, other_token, at=old)), Issued)
        assert service.issuer_counts["clock_skewed"] == 1
        assert isinstance(await owner.ask(owner.enroll(OTHER, other_token)), Issued)


async def test_a_site_identity_speaks_for_its_own_site_only(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        # the issuer answers a site once it has a grant: before, nobody would
        asker = Asker(server.url, creds)
        with pytest.raises(nats.errors.NoRespondersError):
            await asker.ask(asker.enroll(DRONE, "not-minted"))
        await minted(service)
        token = await minted(service, "site2-00000000aa", site="site2")
        # its own subject, naming another site: refused by the issuer
        refused(
            await asker.ask(asker.enroll("site2-00000000aa", token, site="site2")), Refusal.FORGED
        )
        # the other site's subject: refused by the server, never reaches the issuer
        with pytest.raises(nats.errors.TimeoutError):
            await asker.ask(asker.enroll("site2-00000000aa", token, site="site2"), "site2")
        assert any("permissions violation" in error for error in asker.errors), asker.errors
        assert service.issuer_counts["issued_enroll"] == 0


async def test_an_expired_token_gives_nothing(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    settings = manager_settings(tmp_path, server, authority, token_valid_s=0.5)
    async with running_manager(settings) as service:
        token = await minted(service)
        await asyncio.sleep(1.0)
        asker = Asker(server.url, site_bootstrap(tmp_path, authority))
        refused(await asker.ask(asker.enroll(DRONE, token)), Refusal.EXPIRED)
        assert service.issuer_counts["refused_expired"] == 1


async def test_a_token_minted_before_a_manager_restart_works_after_it(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    settings = manager_settings(tmp_path, server, authority)
    async with running_manager(settings) as service:
        token = await minted(service)
    async with running_manager(settings) as service:
        await asyncio.wait_for(service.ready.wait(), 30)
        agent = bootstrapped(tmp_path, server, authority, token)
        await drone_life(service, agent, reason="restart test")


async def test_a_drone_whose_bootstrap_is_refused_keeps_its_gate_shut_and_says_why(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    server, authority = secured
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        await minted(service)
        agent = bootstrapped(tmp_path, server, authority, "not-the-token")
        with caplog.at_level(logging.ERROR, "remote_agent"):
            async with running(agent) as run:
                await wait_until(lambda: "refused this drone's identity" in caplog.text, 30)
                await asyncio.sleep(0.5)
                assert not agent.gate_open
                assert await run.stop() == 128 + 15
        assert "forged" in caplog.text
        assert service.issuer_counts["refused_forged"] == 1


async def test_the_agent_renews_its_identity_and_stays_on_the_bus(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """JWTs of 3 s: renewed at half their life, each time a reconnect with the new one"""
    server, authority = secured
    settings = manager_settings(tmp_path, server, authority, jwt_valid_s=3)
    async with running_manager(settings) as service:
        agent = bootstrapped(tmp_path, server, authority, await minted(service))
        async with running(agent) as run:
            await wait_until(lambda: agent.gate_open, 30, "the gate to open")
            await wait_until(lambda: service.issuer_counts["issued_renew"] >= 3, 30, "renewals")
            # past several expiries of the first JWT: still on the bus, commands still arrive
            control = service.control
            assert control is not None
            answers = [(await control.status(SITE, DRONE)).outcome for _ in range(20)]
            assert answers.count("answered") >= 15, answers  # a few may fall into a reconnect
            assert agent.gate_open
            assert await run.stop() == 128 + 15
        view = service.registry.view(SITE, DRONE)
        assert view is not None and view.state is ev.DroneState.EXITING


async def test_the_issuer_answers_again_after_the_server_restarts(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """Its connections reconnect (the manager's session goes on); no thread is left over"""
    server, authority = secured
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        await server.restart()
        async with running(bootstrapped(tmp_path, server, authority, token)):
            await wait_until(lambda: up(service.registry), 60, "the drone up")
        assert service.issuer_counts["issued_enroll"] == 1
        assert len(issuer_threads()) == 1
    assert not issuer_threads()


async def test_an_identity_that_expired_while_the_issuer_was_away_is_renewed_after(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """
    The manager away longer than a JWT lives: the server closes the drone's connection
    at its expiry; the gate stays open, events wait, and once the issuer is back the
    drone connects again with a new JWT, its subscriptions made again
    """
    server, authority = secured
    settings = manager_settings(tmp_path, server, authority, jwt_valid_s=3)
    async with running_manager(settings) as service:
        agent = bootstrapped(tmp_path, server, authority, await minted(service))
    async with running(agent) as run:
        async with running_manager(settings) as service:
            await wait_until(lambda: agent.gate_open, 30, "the gate to open")
        publisher = agent.emitter.publisher
        assert publisher is not None
        await wait_until(lambda: not publisher.connected.is_set(), 30, "the JWT to expire")
        assert agent.gate_open and publisher.refused is None
        async with running_manager(settings) as service:
            await wait_until(publisher.connected.is_set, 30, "a new connection")
            control = service.control
            assert control is not None
            drained = await control.drain(SITE, DRONE, reason="after the outage")
            assert drained.command is not None, drained  # the command subscription is back
            assert await run.exit_code(30) == 0


async def test_a_revoked_drone_gets_no_new_identity_and_is_cut_off_at_its_expiry(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    server, authority = secured
    settings = manager_settings(tmp_path, server, authority, jwt_valid_s=3)
    async with running_manager(settings) as service:
        agent = bootstrapped(tmp_path, server, authority, await minted(service))
        async with running(agent) as run:
            await wait_until(lambda: agent.gate_open, 30, "the gate to open")
            publisher = agent.emitter.publisher
            assert publisher is not None
            assert service.issuer is not None
            with caplog.at_level(logging.ERROR, "remote_agent"):
                await service.issuer.grants.revoke(SITE, DRONE, "test")
                await wait_until(lambda: not agent.gate_open, 30, "the gate to shut")
                await wait_until(lambda: not publisher.connected.is_set(), 30, "the cut-off")
            assert "revoked" in caplog.text
            assert service.issuer_counts["refused_revoked"] >= 1
            assert await run.exit_code(30) is not None


async def test_the_issuer_answers_only_into_the_sites_own_inbox(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """
    A request whose reply subject is another drone's event or record: the issuer, which
    may publish anywhere, would write there for the site; it answers nothing instead
    """
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        asker = Asker(server.url, creds)
        nc = await connect(server.url, user_credentials=str(creds), allow_reconnect=False)
        targets = [
            NS.event(SITE, OTHER, "drained"),
            f"$KV.{NS.record_bucket}.{SITE}.{OTHER}",
            f"{bootstrap_inbox('site2')}.x",
        ]
        try:
            for target in targets:
                await nc.publish(
                    NS.bootstrap(SITE), ev.encode(asker.enroll(DRONE, token)), reply=target
                )
            await nc.flush()
            await wait_until(
                lambda: service.issuer_counts["dropped_reply_subject"] == len(targets), 10
            )
        finally:
            await close(nc)
        control = service.control
        assert control is not None
        js = control.nc.jetstream()
        info = await js.stream_info(NS.event_stream, subjects_filter=NS.drone_events(SITE, OTHER))
        assert not info.state.subjects
        assert await control.store.read(SITE, OTHER) is None
        # the token was not spent by the dropped requests
        assert isinstance(await asker.ask(asker.enroll(DRONE, token)), Issued)


async def test_the_worker_does_not_inherit_the_token(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The startd (and so its payloads) runs without the token in its environment"""
    server, authority = secured
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        monkeypatch.setenv("TardisDroneCobaldRemoteToken", token)
        monkeypatch.setenv("COBALD_REMOTE_TOKEN", token)
        seen = tmp_path / "worker-env"
        agent = Agent(
            agent_settings(
                tmp_path,
                server.url,
                DRONE,
                command=["sh", "-c", f"env > {seen}; exec sleep 3600"],
                bootstrap_token=token,
                bootstrap_creds=site_bootstrap(tmp_path, authority),
            )
        )
        async with running(agent) as run:
            await wait_until(lambda: agent.gate_open and seen.exists(), 30, "the worker")
            assert await run.stop() == 128 + 15
        assert token not in seen.read_text()
