"""
A process holding one drone's credentials, as the hostile tests play it: its connection,
its events and its record writes, and the manager it lies to
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import nats.js.errors
from nats.aio.client import Client

from broker.manager.service import ManagerService, ManagerSettings
from remote_agent.protocol import events as ev
from remote_agent.protocol.connect import connect
from remote_agent.protocol.names import EXPECTED_LAST, Namespace
from support import drones
from support.manager import running_manager

NS = Namespace()
SITE = "site1"
DRONE = "site1-00000000aa"
RECORD_SUBJECT = f"$KV.{NS.record_bucket}.{NS.record_key(SITE, DRONE)}"
#: the drone the hostile one tries to speak for
OTHER = "site1-00000000bb"
OTHER_RECORD = f"$KV.{NS.record_bucket}.{NS.record_key(SITE, OTHER)}"
#: the direct get of the hostile drone's own key, which the server answers to any reply subject
OWN_DIRECT_GET = f"$JS.API.DIRECT.GET.KV_{NS.record_bucket}.{RECORD_SUBJECT}"


@contextlib.asynccontextmanager
async def manager(url: str, creds: Path | None = None) -> AsyncIterator[ManagerService]:
    settings = ManagerSettings(
        servers=[url], creds=str(creds) if creds else None, retry_s=0.2, lost_check_s=0.2
    )
    async with running_manager(settings) as service:
        yield service


@contextlib.asynccontextmanager
async def as_drone(url: str, creds: Path) -> AsyncIterator[Client]:
    """A connection with the drone's own credentials, as any process on it may open"""
    nc = await connect(url, user_credentials=str(creds), inbox_prefix=f"_INBOX_{DRONE}")
    try:
        yield nc
    finally:
        await nc.close()


async def publish(nc: Client, event: ev.Event) -> int:
    """Publish an event as an agent does (with its ``Nats-Msg-Id``); its stream sequence"""
    return await drones.publish(nc.jetstream(), NS, event)


async def write_record(nc: Client, subject: str, value: bytes) -> None:
    """Write a key as a record writer does: a compare-and-set over its newest revision"""
    js = nc.jetstream()
    try:
        last = (await js.get_msg(f"KV_{NS.record_bucket}", subject=subject, direct=True)).seq
    except nats.js.errors.NotFoundError:
        last = 0
    await js.publish(subject, value, headers={EXPECTED_LAST: str(last or 0)})
