"""
Connecting to NATS without leaving a socket behind: every connection goes through :func:`connect`

``nats.connect`` creates its client inside the call, so a caller whose connect fails or is
cancelled never gets the client to close; nats-py leaves the socket open then.
:func:`credentials_refused` tells a refusal of the credentials from any other failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats.errors
from nats.aio.client import Client

#: the texts of nats-server's errors that refuse a user's credentials, lower case (the
#: constants ``AUTHORIZATION_ERR``, ``AUTHENTICATION_REVOKED_ERR`` ... of nats.go); nats-py
#: raises the refusal of a CONNECT as a plain ``Error`` with the server's text
#: (nats/aio/client.py, ``_process_connect_init``)
_REFUSALS = (
    "authorization violation",
    "user authentication revoked",
    "user authentication expired",
    "account authentication expired",
)


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


def credentials_refused(err: BaseException | None) -> str | None:
    """The server's reason if ``err`` says that it refused the credentials, else ``None``"""
    if isinstance(err, nats.errors.AuthorizationError):
        return _REFUSALS[0]
    if not isinstance(err, nats.errors.Error):
        return None
    text = str(err).lower()
    return next((reason for reason in _REFUSALS if reason in text), None)
