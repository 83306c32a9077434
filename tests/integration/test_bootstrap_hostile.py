"""
Attacks on bootstrapped identities from a worker node, against a real nats-server in operator mode

What another drone of the site can do with the site's shared bootstrap identity: read the
issuer's replies (a JWT for a key it does not hold: useless), send the issuer hostile bytes
or a flood (refused, counted, throttled per site, and no grant changes), or present the key
of a drone that ended (refused) or was retired (its grant is gone).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg
from support.agent import SITE, drone_life, running
from support.agent import settings as agent_settings
from support.bootstrap import DRONE, Asker, manager_settings, minted, refused, site_bootstrap, up
from support.manager import running_manager
from support.waiting import wait_until

from broker.manager.service import ManagerService
from broker.server.auth.jwt import decode_jwt
from broker.server.embedded import EmbeddedServer
from remote_agent.agent import Agent
from remote_agent.agent.identity import SEED_FILE
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import (
    MAX_BOOTSTRAP_MESSAGE,
    Issued,
    IssueRefused,
    Refusal,
    decode_bootstrap_reply,
)
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.names import Namespace, bootstrap_inbox, inbox_prefix

pytestmark = pytest.mark.timeout(120)
NS = Namespace()
OTHER = "site1-00000000bb"
OTHER_SITE_DRONE = "site2-00000000aa"


async def grant_revision(service: ManagerService, drone: str = DRONE, site: str = SITE) -> int:
    assert service.issuer is not None
    found = await service.issuer.grants.get(site, drone)
    assert found is not None
    return found[1]


def answered(service: ManagerService) -> int:
    """Requests the issuer decided (every count but the tokens it minted)"""
    counts = dict(service.issuer_counts)  # a copy: the issuer's thread counts meanwhile
    return sum(n for name, n in counts.items() if name != "minted")


async def test_a_bootstrap_reply_read_by_another_drone_of_the_site_gives_it_nothing(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        spy = Asker(server.url, creds).with_key(7)
        replies: list[bytes] = []

        async def overheard(msg: Msg) -> None:
            replies.append(msg.data)

        async with spy.connected() as nc:
            # every reply to the site's bootstrap identity, the real drone's included
            await nc.subscribe(f"{bootstrap_inbox(SITE)}.>", cb=overheard)
            await nc.flush()
            agent = Agent(
                agent_settings(
                    tmp_path, server.url, DRONE, bootstrap_token=token, bootstrap_creds=creds
                )
            )
            async with running(agent) as run:
                await wait_until(lambda: bool(replies), 30, "the drone's reply, overheard")
                issued = decode_bootstrap_reply(replies[0])
                assert isinstance(issued, Issued), issued
                seed = (agent.settings.spool_dir / SEED_FILE).read_bytes().strip()
                assert seed not in replies[0]  # a JWT, never the drone's seed
                claims = decode_jwt(issued.jwt)
                assert claims["name"] == f"drone-{DRONE}" and claims["sub"] != spy.public
                # the JWT with the spy's own key: the server refuses the connection
                with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
                    await asyncio.wait_for(
                        connect(
                            server.url,
                            user_jwt_cb=lambda: issued.jwt.encode(),
                            signature_cb=lambda nonce: base64.b64encode(
                                spy.key.sign(nonce.encode())
                            ),
                            allow_reconnect=False,
                            max_reconnect_attempts=0,
                        ),
                        30,
                    )
                # nor does the issuer renew it for the spy's key, or enroll it again
                refused(await spy.ask(spy.renew(DRONE), nc=nc), Refusal.FORGED)
                refused(await spy.ask(spy.enroll(DRONE, token), nc=nc), Refusal.REUSED)
                # the real drone runs on its identity all the same
                await wait_until(lambda: up(service.registry), 30, "the drone's events")
                assert agent.gate_open
                assert await run.stop() == 128 + 15
        assert service.issuer_counts["issued_enroll"] == 1
        assert service.issuer_counts["issued_renew"] == 0


async def test_a_drone_that_ended_renews_no_more_and_a_retired_one_has_no_grant(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    settings = dataclasses.replace(
        manager_settings(tmp_path, server, authority), lost_check_s=0.2, retain_ended_s=3.0
    )
    async with running_manager(settings) as service:
        token = await minted(service)
        agent = Agent(
            agent_settings(
                tmp_path, server.url, DRONE, bootstrap_token=token, bootstrap_creds=creds
            )
        )
        await drone_life(service, agent, reason="ended test")  # drained, and exited
        await wait_until(
            lambda: (view := service.registry.view(SITE, DRONE)) is not None and bool(view.ended),
            10,
            "the drone ended",
        )
        # the drone's own key, as a thief of its spool (or the exited agent) would hold it
        asker = Asker(server.url, creds).with_seed_of(agent.settings.spool_dir)
        refused(await asker.ask(asker.renew(DRONE)), Refusal.ENDED)
        refused(await asker.ask(asker.enroll(DRONE, token)), Refusal.ENDED)
        await wait_until(lambda: service.registry.view(SITE, DRONE) is None, 30, "retired")
        assert service.issuer is not None
        assert await service.issuer.grants.get(SITE, DRONE) is None
        refused(await asker.ask(asker.renew(DRONE)), Refusal.UNKNOWN)
        refused(await asker.ask(asker.enroll(DRONE, token)), Refusal.UNKNOWN)
        assert service.issuer_counts["refused_ended"] == 2
        assert service.issuer_counts["refused_unknown"] == 2


def hostile_requests(asker: Asker, token: str) -> dict[str, bytes]:
    """Requests for ``DRONE`` that no issuer may act on, by what is wrong with them"""
    good = msgspec.msgpack.decode(ev.encode(asker.enroll(DRONE, token)))

    def changed(**fields: Any) -> bytes:
        return msgspec.msgpack.encode({**good, **fields})

    def with_raw(name: str, raw: bytes) -> bytes:
        # the request with one more field whose value is ``raw`` msgpack
        marker = "\x00" * 16
        data = msgspec.msgpack.encode({**good, name: marker})
        return data.replace(msgspec.msgpack.encode(marker), raw)

    deep = 4000
    return {
        "oversized token": changed(token="x" * (MAX_BOOTSTRAP_MESSAGE - 512)),
        "nested token": changed(token=[[[[[[[[token]]]]]]]]),
        "deeply nested": b"\x91" * deep + b"\xc0",
        # within what the identity may publish (MAX_BOOTSTRAP_MESSAGE), as all of these
        "deeply nested map": b"\x81\xa1k" * (deep // 2) + b"\xc0",
        "deeply nested unknown field": with_raw("extra", b"\x91" * deep + b"\xc0"),
        "deeply nested token": with_raw("token", b"\x91" * deep + b"\xc0"),
        "at as text": changed(at="yesterday"),
        "at as a number": changed(at=1e300),
        "signature as text": changed(signature="x" * 64),
        "short signature": changed(signature=b"x" * 63),
        "public key as a number": changed(public_key=12),
        "public key not a user key": changed(public_key="A" * 56),
        "site as a list": changed(site=[SITE]),
        "drone missing": msgspec.msgpack.encode({k: v for k, v in good.items() if k != "drone"}),
        "drone as null": changed(drone=None),
        "drone with a wildcard": changed(drone="site1-*"),
        "token as bytes": changed(token=token.encode()),
        "empty token": changed(token=""),
        "a reply's kind": changed(kind="issued"),
        "an unknown kind": changed(kind="grant"),
        "no kind": msgspec.msgpack.encode({k: v for k, v in good.items() if k != "kind"}),
        "a list": msgspec.msgpack.encode(list(good.values())),
        "truncated": ev.encode(asker.enroll(DRONE, token))[:-7],
        "empty": b"",
        "not msgpack": b"\xc1" * 64,
        "json": b'{"kind": "enroll"}',
    }


async def test_hostile_bytes_from_the_bootstrap_identity_change_no_grant_and_are_counted(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        before = await grant_revision(service)
        attacker = Asker(server.url, creds).with_key(3)
        hostile = hostile_requests(attacker, token)
        answers: dict[str, Issued | IssueRefused] = {}
        async with attacker.connected() as nc:
            for name, data in hostile.items():
                answers[name] = await attacker.ask(data, nc=nc)
        wrong = {
            name: answer
            for name, answer in answers.items()
            if not isinstance(answer, IssueRefused) or answer.reason is not Refusal.MALFORMED
        }
        assert not wrong, wrong
        assert service.issuer_counts["refused_malformed"] == len(hostile)
        assert service.issuer_counts["issued_enroll"] == 0
        assert await grant_revision(service) == before
        # past what the issuer decodes, which is what the bootstrap identity may publish
        # at all: the server drops it and cuts the connection
        async with attacker.connected() as nc:
            with pytest.raises((nats.errors.Error, TimeoutError)):
                await attacker.ask(b"\x00" * (MAX_BOOTSTRAP_MESSAGE + 1), nc=nc)
            assert not nc.is_connected  # the server cut it off
        assert service.issuer_counts["refused_malformed"] == len(hostile)
        # the drone's token is still good for the drone
        owner = Asker(server.url, creds).with_key(4)
        assert isinstance(await owner.ask(owner.enroll(DRONE, token)), Issued)


async def test_a_flood_from_one_site_is_throttled_while_another_site_enrolls(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    # a site refills one request each 100 s: nothing the test does in between gets one back
    settings = manager_settings(tmp_path, server, authority, rate_per_s=0.01, burst=5.0)
    async with running_manager(settings) as service:
        token = await minted(service)
        other_token = await minted(service, OTHER_SITE_DRONE, site="site2")
        before = await grant_revision(service)
        flood = 60
        attacker = Asker(server.url, creds).with_key(3)
        async with attacker.connected() as nc:
            answers = await asyncio.gather(
                *(attacker.ask(attacker.enroll(DRONE, f"guess{i}"), nc=nc) for i in range(flood))
            )
            reasons = [a.reason for a in answers if isinstance(a, IssueRefused)]
            assert len(reasons) == flood, answers
            assert reasons.count(Refusal.FORGED) == 5, reasons  # the burst, then nothing
            assert reasons.count(Refusal.THROTTLED) == flood - 5, reasons
            # the site's own drone, with its token, waits like everyone of its site
            owner = Asker(server.url, creds).with_key(4)
            refused(await owner.ask(owner.enroll(DRONE, token)), Refusal.THROTTLED)
            # meanwhile a drone of another site enrolls
            other = Asker(server.url, site_bootstrap(tmp_path, authority, "site2"), "site2")
            issued = await other.with_key(5).ask(other.enroll(OTHER_SITE_DRONE, other_token))
            assert isinstance(issued, Issued), issued
        assert service.issuer_counts["refused_throttled"] == flood - 5 + 1
        assert service.issuer_counts["refused_forged"] == 5
        assert service.issuer_counts["issued_enroll"] == 1
        assert await grant_revision(service) == before


async def test_of_many_keys_racing_for_one_token_at_two_managers_exactly_one_wins(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """The token stolen from the batch system and used at once by several thieves"""
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    settings = manager_settings(tmp_path, server, authority)
    second = dataclasses.replace(settings, durable="second-manager")
    async with running_manager(settings) as one, running_manager(second) as two:
        token = await minted(one)
        await asyncio.wait_for(two.ready.wait(), 30)
        racers = [Asker(server.url, creds).with_key(10 + i) for i in range(24)]
        answers = await asyncio.gather(*(r.ask(r.enroll(DRONE, token)) for r in racers))
        [winner] = [r for r, a in zip(racers, answers, strict=True) if isinstance(a, Issued)]
        for answer in answers:
            if not isinstance(answer, Issued):
                refused(answer, Refusal.REUSED)
        counts = collections.Counter(dict(one.issuer_counts)) + collections.Counter(
            dict(two.issuer_counts)
        )
        assert counts["issued_enroll"] == 1
        assert counts["alarms"] == counts["refused_reused"] == len(racers) - 1
        # the queue group shared the requests (all 24 at one: a chance of 2 in 2**24)
        for service in (one, two):
            assert service.issuer_counts["issued_enroll"] + service.issuer_counts["refused_reused"]
        assert one.issuer is not None
        found = await one.issuer.grants.get(SITE, DRONE)
        assert found is not None and found[0].public_key == winner.public


async def test_the_issuer_answers_only_into_the_site_s_own_bootstrap_inbox(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """
    A reply subject is the asker's to choose, and the issuer publishes with the manager's
    rights: named elsewhere, an answer would land on subjects the bootstrap identity may
    not publish to (another drone's events, record or inbox, the JetStream API)
    """
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        token = await minted(service)
        before = await grant_revision(service)
        targets = [
            NS.event(SITE, OTHER, "drained"),
            NS.record_subject(SITE, OTHER),
            f"{inbox_prefix(OTHER)}.x",
            f"{bootstrap_inbox('site2')}.x",
            f"$JS.API.STREAM.INFO.{NS.event_stream}",
            bootstrap_inbox(SITE),  # the inbox prefix itself is no inbox
        ]
        seen: list[str] = []

        async def landed(msg: Msg) -> None:
            seen.append(msg.subject)

        watcher = await connect(server.url, user_credentials=str(tmp_path / "manager.creds"))
        attacker = Asker(server.url, creds).with_key(3)
        try:
            for target in targets:
                await watcher.subscribe(target, cb=landed)
            await watcher.flush()
            async with attacker.connected() as nc:
                for target in targets:
                    for data in (b"garbage", ev.encode(attacker.enroll(DRONE, token))):
                        await nc.publish(NS.bootstrap(SITE), data, reply=target)
                await nc.flush()
                sent = 2 * len(targets)
                await wait_until(lambda: answered(service) >= sent, 10, "every request handled")
                # the issuer still answers a request asked the right way
                refused(await attacker.ask(b"garbage", nc=nc), Refusal.MALFORMED)
            await watcher.flush()
        finally:
            await close(watcher)
        assert not seen, seen
        assert service.issuer_counts["dropped_reply_subject"] == sent
        assert service.issuer_counts["refused_malformed"] == 1
        assert service.issuer_counts["issued_enroll"] == 0
        assert await grant_revision(service) == before  # the token was not spent
        owner = Asker(server.url, creds).with_key(4)
        assert isinstance(await owner.ask(owner.enroll(DRONE, token)), Issued)


async def test_a_revocation_before_the_drone_enrolled_outlives_a_new_token(
    tmp_path: Path, secured: tuple[EmbeddedServer, Path]
) -> None:
    """Revoked while its job waits (its token seen stolen): a deploy again mints no way in"""
    server, authority = secured
    creds = site_bootstrap(tmp_path, authority)
    async with running_manager(manager_settings(tmp_path, server, authority)) as service:
        stolen = await minted(service)
        assert service.issuer is not None
        assert await service.issuer.grants.revoke(SITE, DRONE, "token seen stolen") is not None
        again = await minted(service)  # TARDIS deploys the drone again
        thief = Asker(server.url, creds).with_key(3)
        for token in (stolen, again):
            reply = await thief.ask(thief.enroll(DRONE, token))
            assert isinstance(reply, IssueRefused), reply
        found = await service.issuer.grants.get(SITE, DRONE)
        assert found is not None and found[0].revoked == "token seen stolen"
        assert service.issuer_counts["issued_enroll"] == 0
