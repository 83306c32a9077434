"""The control API against real handshake records, a fake agent's responder, and races"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from support.drones import FakeDrone, answer_commands, publish
from support.manager import running_manager
from support.waiting import wait_until

from broker.jetstream.messages import PullSettings
from broker.manager.control import Control
from broker.manager.outcomes import CommandOutcome, DrainOutcome, IdleOutcome, ReleaseOutcome
from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.manager.verdict import Removal
from broker.server.embedded import EmbeddedServer
from remote_agent.protocol import events as ev
from remote_agent.protocol.handshake import RecordStore
from remote_agent.protocol.names import Namespace

NS = Namespace()
SITE = "site1"


@pytest.fixture
async def control(nc: Client, store: RecordStore) -> Control:
    """The manager's control API (with the proof key); ``store`` writes as a drone would"""
    return await Control.open(nc, Registry(NS), request_timeout_s=0.5)


def _deadline(minutes: float = 30) -> dt.datetime:
    return ev.utcnow() + dt.timedelta(minutes=minutes)


def _accept(command: ev.AnyCommand) -> tuple[ev.Outcome, str]:
    if isinstance(command, ev.DrainCommand):
        return ev.Outcome.DRAIN_ACCEPTED, "gate closed"
    if isinstance(command, ev.ReleaseIfIdleCommand):
        return ev.Outcome.BUSY, "1 payload running"
    return ev.Outcome.STATUS, "busy"


async def test_release_before_the_agent_came_up(
    control: Control, store: RecordStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    result = await control.release(SITE, "site1-0000000001", note="demand dropped")
    said = [(r.name, r.getMessage()) for r in caplog.records if "before its agent" in r.message]
    assert said == [  # the manager's line, under the central side's tree
        (
            "cobald.runtime.cobald_remote.control",
            f"released {SITE}/site1-0000000001 before its agent came up",
        )
    ]
    assert result.outcome is ReleaseOutcome.RELEASED and result.may_remove
    assert result.phase is ev.RecordPhase.RELEASED
    verdict = control.may_remove(SITE, "site1-0000000001", lbs_running=True)
    assert verdict.allowed and verdict.reason is Removal.RELEASED_BY_MANAGER
    # the agent that comes up now finds it released
    claimed = await store.claim(SITE, "site1-0000000001", "inc1")
    assert claimed.record.phase is ev.RecordPhase.RELEASED
    claims = {r.name for r in caplog.records if r.message.startswith("claim of")}
    assert claims == {"remote_agent.handshake"}  # the drone's store keeps the drone's logger
    # idempotent
    again = await control.release(SITE, "site1-0000000001")
    assert again.outcome is ReleaseOutcome.RELEASED


async def test_release_after_the_agent_came_up_drains_it(
    nc: Client, control: Control, store: RecordStore
) -> None:
    drone = FakeDrone(SITE, "site1-0000000002")
    await store.claim(SITE, drone.drone, drone.incarnation)
    seen: list[ev.AnyCommand] = []
    sub = await answer_commands(nc, NS, drone, _accept, seen)
    try:
        result = await control.release(SITE, drone.drone, reason="demand dropped")
    finally:
        await sub.unsubscribe()
    assert result.outcome is ReleaseOutcome.DRAINING and not result.may_remove
    assert result.drain is not None and result.drain.outcome is DrainOutcome.ACCEPTED
    assert result.phase is ev.RecordPhase.DRAINING
    assert [type(c) for c in seen] == [ev.DrainCommand]
    record = await store.read(SITE, drone.drone)
    assert record is not None and record.record.drain == result.drain.intent
    assert seen[0].request_id == result.drain.intent.request_id  # type: ignore[union-attr]
    verdict = control.may_remove(SITE, drone.drone, lbs_running=False)
    assert not verdict.allowed and verdict.reason is Removal.DRAINING


async def test_drain_outcomes(nc: Client, control: Control, store: RecordStore) -> None:
    drone = FakeDrone(SITE, "site1-0000000003")
    assert (await control.drain(SITE, drone.drone)).outcome is DrainOutcome.NOT_ANNOUNCED
    assert await store.read(SITE, drone.drone) is None  # drain never creates a record

    await store.claim(SITE, drone.drone, drone.incarnation)
    # nobody answers: the intent is recorded anyway
    unanswered = await control.drain(SITE, drone.drone, _deadline(), "maintenance")
    assert unanswered.outcome is DrainOutcome.UNANSWERED and unanswered.intent_recorded
    assert unanswered.command is not None
    assert unanswered.command.outcome is CommandOutcome.NO_RESPONDERS
    record = await store.read(SITE, drone.drone)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINING
    assert record.record.drain is not None and record.record.drain.reason == "maintenance"

    again = await control.drain(SITE, drone.drone, _deadline(5))
    assert again.outcome is DrainOutcome.ALREADY_DRAINING
    assert again.intent == record.record.drain  # the first intent stays in effect

    await store.finish(SITE, drone.drone, drone.incarnation, ev.RecordPhase.DEADLINE_EXPIRED)
    expired = await control.drain(SITE, drone.drone)
    assert expired.outcome is DrainOutcome.DEADLINE_EXPIRED
    # the agent's word on its deadline counts once the manager's clock agrees
    assert control.may_remove(SITE, drone.drone, lbs_running=True).reason is (
        Removal.DEADLINE_NOT_DUE
    )
    assert unanswered.intent is not None
    due = unanswered.intent.deadline.timestamp()
    verdict = control.may_remove(SITE, drone.drone, lbs_running=True, now=due)
    assert verdict.allowed and verdict.reason is Removal.DEADLINE_EXPIRED
    await store.finish(SITE, drone.drone, drone.incarnation, ev.RecordPhase.DRAINED)
    drained = await control.drain(SITE, drone.drone)
    assert drained.outcome is DrainOutcome.ALREADY_DRAINED
    verdict = control.may_remove(SITE, drone.drone, lbs_running=True)
    assert verdict.allowed and verdict.reason is Removal.DRAINED_BY_AGENT

    await control.release(SITE, "site1-0000000004")
    released = await control.drain(SITE, "site1-0000000004")
    assert released.outcome is DrainOutcome.RELEASED


async def test_drain_while_the_agent_claims_its_record(
    control: Control, store: RecordStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent claims its record just after the drain found none: the drain goes into it"""
    drone = FakeDrone(SITE, "site1-0000000010")
    record_drain = control.store.request_drain
    calls: list[str] = []

    async def claimed_meanwhile(*args: object, **kwargs: object) -> object:
        calls.append(drone.drone)
        try:
            return await record_drain(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            if await store.read(SITE, drone.drone) is None:
                await store.claim(SITE, drone.drone, drone.incarnation)

    monkeypatch.setattr(control.store, "request_drain", claimed_meanwhile)
    result = await control.drain(SITE, drone.drone, _deadline(), "demand dropped")
    assert len(calls) == 2  # the first found no record, the second the agent's
    assert result.outcome is DrainOutcome.UNANSWERED and result.intent_recorded
    record = await store.read(SITE, drone.drone)
    assert record is not None and record.record.phase is ev.RecordPhase.DRAINING
    assert record.record.drain == result.intent


async def test_drain_answers(nc: Client, control: Control, store: RecordStore) -> None:
    answers = {
        ev.Outcome.DRAIN_ACCEPTED: DrainOutcome.ACCEPTED,
        ev.Outcome.ALREADY_DRAINING: DrainOutcome.ACCEPTED,
        ev.Outcome.DRAINED: DrainOutcome.DRAINED,
        ev.Outcome.REFUSED: DrainOutcome.REFUSED,
    }
    for number, (answer, expected) in enumerate(answers.items()):
        drone = FakeDrone(SITE, f"site1-00000001{number:02x}")
        await store.claim(SITE, drone.drone, drone.incarnation)
        sub = await answer_commands(nc, NS, drone, lambda _c, a=answer: (a, "as told"))
        try:
            result = await control.drain(SITE, drone.drone, _deadline())
        finally:
            await sub.unsubscribe()
        assert result.outcome is expected, answer
        assert result.command is not None and result.command.agent_outcome is answer


async def test_bad_and_missing_replies(nc: Client, control: Control, store: RecordStore) -> None:
    drone = FakeDrone(SITE, "site1-0000000005")

    async def garbage(msg: Msg) -> None:
        await nc.publish(msg.reply, b"\xc1")

    async def error(msg: Msg) -> None:
        await nc.publish(msg.reply, ev.encode(ev.ErrorReply(error="cannot parse")))

    async def other_drone(msg: Msg) -> None:
        reply = ev.Reply(
            site=SITE,
            drone="site1-0000000099",
            request_id=ev.decode_command(msg.data).request_id,
            outcome=ev.Outcome.STATUS,
            snapshot=drone.snapshot(),
        )
        await nc.publish(msg.reply, ev.encode(reply))

    async def silent(msg: Msg) -> None:
        pass

    subject = NS.command(SITE, drone.drone)
    for responder, expected in (
        (garbage, CommandOutcome.BAD_REPLY),
        (error, CommandOutcome.ERROR_REPLY),
        (other_drone, CommandOutcome.BAD_REPLY),
        (silent, CommandOutcome.TIMEOUT),
    ):
        sub = await nc.subscribe(subject, cb=responder)
        try:
            result = await control.status(SITE, drone.drone)
        finally:
            await sub.unsubscribe()
        assert result.outcome is expected, responder
        assert result.detail
    assert (await control.status(SITE, drone.drone)).outcome is CommandOutcome.NO_RESPONDERS
    sub = await answer_commands(nc, NS, drone, _accept)
    try:
        status = await control.status(SITE, drone.drone)
    finally:
        await sub.unsubscribe()
    assert status.outcome is CommandOutcome.ANSWERED
    assert status.snapshot == drone.snapshot()


async def test_release_if_idle(nc: Client, control: Control, store: RecordStore) -> None:
    never = await control.release_if_idle(SITE, "site1-0000000006")
    assert never.outcome is IdleOutcome.RELEASED and never.phase is ev.RecordPhase.RELEASED

    drone = FakeDrone(SITE, "site1-0000000007")
    await store.claim(SITE, drone.drone, drone.incarnation)
    assert (await control.release_if_idle(SITE, drone.drone)).outcome is IdleOutcome.UNANSWERED
    sub = await answer_commands(nc, NS, drone, _accept)
    try:
        busy = await control.release_if_idle(SITE, drone.drone)
    finally:
        await sub.unsubscribe()
    assert busy.outcome is IdleOutcome.BUSY
    sub = await answer_commands(nc, NS, drone, lambda _c: (ev.Outcome.RELEASED, "idle"))
    try:
        idle = await control.release_if_idle(SITE, drone.drone)
    finally:
        await sub.unsubscribe()
    assert idle.outcome is IdleOutcome.RELEASED


async def test_release_races_claim(control: Control, store: RecordStore) -> None:
    """Whoever wins, both sides agree, and may_remove says yes only if the manager won"""
    drones = [f"site1-race{i:06x}" for i in range(60)]

    async def agent(drone: str, delay: float) -> ev.RecordPhase:
        await asyncio.sleep(delay)
        return (await store.claim(SITE, drone, "inc")).record.phase

    async def manager(drone: str, delay: float) -> ReleaseOutcome:
        await asyncio.sleep(delay)
        return (await control.release(SITE, drone)).outcome

    delays = [(i % 7) * 0.002 for i in range(len(drones))]
    results = await asyncio.gather(
        *(agent(d, delays[i]) for i, d in enumerate(drones)),
        *(manager(d, delays[-i - 1]) for i, d in enumerate(drones)),
    )
    claims, releases = results[: len(drones)], results[len(drones) :]
    for drone, claim, release in zip(drones, claims, releases, strict=True):
        removable = control.may_remove(SITE, drone, lbs_running=True).allowed
        if release is ReleaseOutcome.RELEASED:
            assert claim is ev.RecordPhase.RELEASED and removable
        else:
            # the agent won; it never saw "released", and the drone was drained instead
            assert claim is ev.RecordPhase.UP and not removable


async def test_lost_agent_and_lbs(
    nc: Client, js: JetStreamContext, control: Control, store: RecordStore
) -> None:
    drone = FakeDrone(SITE, "site1-0000000008")
    await store.claim(SITE, drone.drone, drone.incarnation)
    event = drone.heartbeat()
    control.registry.apply(event, drone.subject(event, NS), time.time())
    later = time.time() + 2 * control.registry.lost_after_s
    assert control.may_remove(SITE, drone.drone, lbs_running=False, now=later).reason is (
        Removal.LOST_AND_NOT_RUNNING
    )
    assert not control.may_remove(SITE, drone.drone, lbs_running=True, now=later)
    assert not control.may_remove(SITE, drone.drone, lbs_running=None, now=later)
    assert not control.may_remove(SITE, drone.drone, lbs_running=False)


# --------------------------------------------------------------------------- with the service


@contextlib.asynccontextmanager
async def _service(server: EmbeddedServer) -> AsyncIterator[ManagerService]:
    settings = ManagerSettings(
        servers=[server.url],
        retry_s=0.2,
        request_timeout_s=0.5,
        pull=PullSettings(batch=50, expires_s=2.0, idle_heartbeat_s=0.5),
    )
    async with running_manager(settings) as service:
        yield service


async def test_service_sees_records_written_by_agents(
    nats_server: EmbeddedServer, js: JetStreamContext, store: RecordStore
) -> None:
    drone = FakeDrone(SITE, "site1-0000000009")
    async with _service(nats_server) as service:
        await publish(js, NS, drone.started())
        await store.claim(SITE, drone.drone, drone.incarnation)

        def phase() -> ev.RecordPhase | None:
            view = service.registry.view(SITE, drone.drone)
            return view.phase if view is not None else None

        await wait_until(lambda: phase() is ev.RecordPhase.UP, what="claim seen")
        assert service.control is not None
        drain = await service.control.drain(SITE, drone.drone, _deadline())
        assert drain.outcome is DrainOutcome.UNANSWERED
        await wait_until(lambda: phase() is ev.RecordPhase.DRAINING, what="drain seen")
        assert not service.control.may_remove(SITE, drone.drone, lbs_running=True)
        await store.finish(SITE, drone.drone, drone.incarnation, ev.RecordPhase.DRAINED)
        await wait_until(lambda: phase() is ev.RecordPhase.DRAINED, what="drained seen")
        assert service.control.may_remove(SITE, drone.drone, lbs_running=True)
        view = service.registry.view(SITE, drone.drone)
        assert view is not None and view.record is not None and view.record.stored is not None
        # the KV watch survives a broker restart
        other = FakeDrone(SITE, "site1-000000000a")
        await nats_server.restart()
        await wait_until(lambda: service.ready.is_set())
        for _ in range(100):
            try:
                await store.claim(SITE, other.drone, other.incarnation)
                break
            except Exception:  # the test's own client may still be reconnecting
                await asyncio.sleep(0.1)

        def other_phase() -> ev.RecordPhase | None:
            view = service.registry.view(SITE, other.drone)
            return view.phase if view is not None else None

        await wait_until(lambda: other_phase() is ev.RecordPhase.UP, 40, what="after restart")
