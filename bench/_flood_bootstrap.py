"""
The bootstrap side of the flood benchmark: one site's flooding client, another site's drones

The flooder holds a site's bootstrap credentials (what every drone job of the site
carries) and sends enrollment requests to the issuer as fast as one client can, never
waiting for an answer; each is signed by the key it names, for a drone nobody minted a
token for, so the requests the site's rate limit lets through cost the issuer its whole
check. The enrolling drones of another site ask one at a time as the agent does
(:meth:`~remote_agent.agent.identity.BootstrapIdentity._ask`: a new connection on the
site's bootstrap identity, the signed request with the drone's token, the reply, close),
started at a steady rate, each timed from when it was due. Each runs in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common
import nats.errors
import nkeys
from _issuance_drones import NS, Drone

from remote_agent.protocol.bootstrap import EnrollRequest, Issued, signing_input
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import encode
from remote_agent.protocol.names import bootstrap_inbox

#: distinct requests the flooder cycles through (signing each anew would slow it down)
FLOOD_REQUESTS = 64


def flood_requests(site: str, n: int = FLOOD_REQUESTS) -> list[bytes]:
    """``n`` enrollments of ``site``, each signed by its own key, for drones never minted"""
    at = dt.datetime.now(dt.UTC)
    out = []
    for i in range(n):
        key = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        public = key.public_key.decode()
        drone = _common.drone_name(site, 0xF000000 + i)
        signature = key.sign(signing_input("enroll", site, drone, public, at))
        request = EnrollRequest(
            site=site,
            drone=drone,
            public_key=public,
            at=at,
            signature=signature,
            token="x" * 43,
        )
        out.append(encode(request))
    return out


async def bootstrap_flooder(url: str, creds: str, site: str, duration_s: float) -> dict[str, Any]:
    """Send ``site``'s enrollments for ``duration_s`` as fast as the connection takes them"""

    async def quiet(err: Exception) -> None:
        pass

    requests = flood_requests(site)
    subject, reply = NS.bootstrap(site), f"{bootstrap_inbox(site)}.flood"
    nc = await connect(
        url,
        user_credentials=creds,
        inbox_prefix=bootstrap_inbox(site),
        error_cb=quiet,
        pending_size=8 * 1024 * 1024,
    )
    sent, cpu, started = 0, _common.cpu_seconds(), time.monotonic()
    deadline = started + duration_s
    while time.monotonic() < deadline:
        for data in requests:
            await nc.publish(subject, data, reply=reply)
        sent += len(requests)
    seconds = time.monotonic() - started
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        await nc.flush(timeout=30)
    await close(nc)
    return {"sent": sent, "seconds": seconds, "cpu_s": _common.cpu_seconds() - cpu}


async def enroller(spec: dict[str, Any]) -> dict[str, Any]:
    """
    Enroll ``spec["drones"]`` one every ``1 / spec["rate_per_s"]`` s until stdin closes

    :returns: each enrollment as ``[due (time.monotonic()), seconds, outcome]``, outcome
        ``issued``, ``timeout``, ``refused_<reason>`` or ``error_<exception type>``
    """
    url, rate = spec["url"], spec["rate_per_s"]
    drones = [Drone(d["site"], d["name"], Path(d["creds"]), url) for d in spec["drones"]]
    for drone, entry in zip(drones, spec["drones"], strict=True):
        drone.arm(entry["token"])
    done: list[list[Any]] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)  # EOF (or anything) on stdin: stop

    async def enroll(drone: Drone, due: float) -> None:
        assert drone.identity is not None
        try:
            reply = await drone.identity._ask()  # the agent's own request path
        except TimeoutError:
            outcome = "timeout"
        except (nats.errors.Error, OSError, SchemaError) as err:
            outcome = f"error_{type(err).__name__}"
        else:
            outcome = "issued" if isinstance(reply, Issued) else f"refused_{reply.reason}"
        done.append([due, time.monotonic() - due, outcome])

    tasks: set[asyncio.Task[None]] = set()
    cpu, started = _common.cpu_seconds(), time.monotonic()
    for i, drone in enumerate(drones):
        due = started + i / rate
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, due - time.monotonic()))
        if stop.is_set():
            break
        task = asyncio.create_task(enroll(drone, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    loop.remove_reader(sys.stdin.fileno())
    await asyncio.gather(*tasks)
    return {
        "enrollments": done,
        "outcomes": dict(Counter(outcome for _, _, outcome in done)),
        "unused_tokens": len(drones) - len(done),
        "cpu_s": _common.cpu_seconds() - cpu,
    }
