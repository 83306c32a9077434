"""
Connecting to NATS without leaving a socket behind: every connection goes through :func:`connect`

``nats.connect`` creates its client inside the call, so a caller whose connect fails or is
cancelled never gets the client to close; nats-py leaves the socket open then.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nats.aio.client import Client


async def connect(servers: str | list[str], **options: Any) -> Client:
    """
    :meth:`nats.aio.client.Client.connect`, closing the client if it fails or is cancelled

    :param servers: one URL or several
    :param options: the keyword arguments of ``nats.connect``
    :raises: whatever the connect raises, after the client was closed
    """
    nc = Client()
    try:
        await nc.connect(servers, **options)
    except BaseException:
        # shielded: a cancel arriving meanwhile propagates, and the close
        # still completes; a failure to close adds nothing to the first error
        with contextlib.suppress(Exception):
            await asyncio.shield(nc.close())
        raise
    return nc
