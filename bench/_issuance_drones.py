"""
The drones' side of the issuance benchmark: a process of its own that enrolls and renews

Its drones ask the way the agent does (:class:`~remote_agent.agent.identity.BootstrapIdentity`),
each timed around its whole request; the echo baselines run from here too, at the same
concurrency, so that every row of a phase is measured the same way.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import _common
import nkeys
from _common import percentiles
from nats.aio.client import Client

from remote_agent.agent.identity import BootstrapIdentity
from remote_agent.protocol.bootstrap import (
    Issued,
    RenewRequest,
    decode_bootstrap_reply,
    signing_input,
)
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.events import encode
from remote_agent.protocol.names import Namespace, bootstrap_inbox

NS = Namespace()
ECHO = "bench.echo"
#: a throttled or unavailable drone asks again after this long (the agent backs off 1 s)
RETRY_S = 0.05


class Drone:
    """One drone of the run: its site, name, key, token and identity"""

    def __init__(self, site: str, name: str, creds: Path, url: str) -> None:
        self.site, self.name = site, name
        self.key = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        self.creds, self.url = creds, url
        self.identity: BootstrapIdentity | None = None
        self.refused: str | None = None

    def arm(self, token: str) -> None:
        self.identity = BootstrapIdentity(
            self.key,
            site=self.site,
            drone=self.name,
            token=token,
            bootstrap_creds=self.creds,
            servers=(self.url,),
            namespace=NS,
            on_refused=self._refused,
        )

    def _refused(self, why: str) -> None:
        self.refused = why

    @property
    def public(self) -> str:
        public: bytes = self.key.public_key
        return public.decode()


async def timed(
    items: Sequence[Any],
    concurrency: int,
    step: Callable[[Any], Awaitable[bool]],
    rate_per_s: float = 0.0,
) -> dict[str, Any]:
    """
    ``step(item)`` for every item, ``concurrency`` at once; times and rate of the successes

    :param rate_per_s: start item ``i`` at ``i / rate_per_s`` seconds (an open loop: its time
        counts from then, waiting for a free slot included); 0: each as soon as a slot is free
    """
    slots = asyncio.Semaphore(concurrency)
    samples: list[float] = []
    failed = 0
    started = time.perf_counter()

    async def one(i: int, item: Any) -> None:
        nonlocal failed
        if rate_per_s:
            due = started + i / rate_per_s
            await asyncio.sleep(due - time.perf_counter())
        async with slots:
            begun = due if rate_per_s else time.perf_counter()
            ok = await step(item)
            if ok:
                samples.append(time.perf_counter() - begun)
            else:
                failed += 1

    cpu = _common.cpu_seconds()
    await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
    seconds = time.perf_counter() - started
    return {
        **percentiles(samples),
        "failed": failed,
        "seconds": seconds,
        "per_s": len(samples) / seconds if seconds else 0.0,
        "client_cpu_s": _common.cpu_seconds() - cpu,
    }


async def echo_steps(
    url: str, creds: Path
) -> tuple[
    Callable[[Drone], Awaitable[bool]],
    Callable[[Drone], Awaitable[bool]],
    Callable[[], Awaitable[None]],
]:
    """The baselines' requests (kept connection, new connection) and how to close the kept one"""
    kept = await connect(url, user_credentials=str(creds))
    body = b"x" * 400  # about an enrollment's size

    async def over_kept(_: Drone) -> bool:
        await kept.request(ECHO, body, timeout=10)
        return True

    async def over_new(drone: Drone) -> bool:
        nc = await connect(
            url,
            user_credentials=str(creds),
            inbox_prefix=bootstrap_inbox(drone.site),
            allow_reconnect=False,
        )
        try:
            await nc.request(ECHO, body, timeout=10)
        finally:
            await close(nc)
        return True

    async def done() -> None:
        await close(kept)

    return over_kept, over_new, done


async def obtain(drone: Drone) -> bool:
    """One of the agent's requests (enroll, then renew), asked again while throttled"""
    assert drone.identity is not None
    for _ in range(200):
        # the agent's own request path: connect on the bootstrap creds, ask, close
        outcome = await drone.identity._obtain()
        if outcome is not None:
            return outcome
        await asyncio.sleep(RETRY_S)
    return False


async def renew_kept(
    url: str, drones: Sequence[Drone], concurrency: int, rate_per_s: float
) -> dict[str, Any]:
    """Renewals over one kept connection per site: the issuer without the connect"""
    clients: dict[str, Client] = {}
    for drone in drones:
        if drone.site not in clients:
            clients[drone.site] = await connect(
                url, user_credentials=str(drone.creds), inbox_prefix=bootstrap_inbox(drone.site)
            )

    async def renew(drone: Drone) -> bool:
        at = dt.datetime.now(dt.UTC)
        signature: bytes = drone.key.sign(
            signing_input("renew", drone.site, drone.name, drone.public, at)
        )
        request = RenewRequest(
            site=drone.site, drone=drone.name, public_key=drone.public, at=at, signature=signature
        )
        for _ in range(200):
            msg = await clients[drone.site].request(NS.bootstrap(drone.site), encode(request), 10)
            reply = decode_bootstrap_reply(msg.data)
            if isinstance(reply, Issued) or reply.reason.permanent:
                return isinstance(reply, Issued)
            await asyncio.sleep(RETRY_S)  # throttled: the signature stays valid for minutes
        return False

    try:
        return await timed(drones, concurrency, renew, rate_per_s)
    finally:
        for nc in clients.values():
            await close(nc)


async def check_identities(url: str, drones: Sequence[Drone]) -> int:
    """How many of ``drones`` connect with their issued JWT and their own key"""
    connected = 0
    for drone in drones:
        identity = drone.identity
        if identity is None or not identity.ready.is_set():
            continue
        nc = await connect(
            url,
            user_jwt_cb=identity.user_jwt,
            signature_cb=identity.sign,
            allow_reconnect=False,
        )
        connected += nc.is_connected
        await close(nc)
    return connected


async def drones_process(spec: dict[str, Any]) -> dict[str, Any]:
    """The drones' side of the run (a process of its own): every phase, timed"""
    url, concurrency, rate = spec["url"], spec["concurrency"], spec["rate_per_s"]
    drones = [Drone(d["site"], d["name"], Path(d["creds"]), url) for d in spec["drones"]]
    for drone, entry in zip(drones, spec["drones"], strict=True):
        drone.arm(entry["token"])
    rows: dict[str, dict[str, Any]] = {}

    async def phase(name: str, run: Awaitable[dict[str, Any]]) -> None:
        begun = time.monotonic()
        rows[name] = await run
        rows[name]["interval"] = (begun, time.monotonic())

    echo = await echo_steps(url, Path(spec["echo_creds"]))
    try:
        await phase("echo, kept connection", timed(drones, concurrency, echo[0], rate))
        await phase("echo, new connection", timed(drones, concurrency, echo[1], rate))
    finally:
        await echo[2]()
    await phase("enroll", timed(drones, concurrency, obtain, rate))
    await phase("renew", timed(drones, concurrency, obtain, rate))
    await phase("renew, kept connection", renew_kept(url, drones, concurrency, rate))
    checked = drones[:: max(1, len(drones) // 20)]
    return {
        "rows": rows,
        "refused_drones": sum(drone.refused is not None for drone in drones),
        "identities_checked": len(checked),
        "identities_connected": await check_identities(url, checked),
    }
