"""
Connecting to NATS without leaving a socket behind: every connection goes through :func:`connect`

``nats.connect`` creates its client inside the call, so a caller whose connect fails or is
cancelled never gets the client to close; nats-py leaves the socket open then. A close
that is cancelled halfway leaves it open too: :func:`close` runs it to the end.
:func:`credentials_refused` tells a refusal of the credentials from any other failure.
:func:`bind_bucket` binds a bucket the server was provisioned with; a missing one is a
:class:`~remote_agent.protocol.errors.HandshakeError` naming the fix.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.transient import patiently

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
        await close(nc)
        raise
    return nc


async def close(nc: Client, timeout_s: float = 5.0) -> None:
    """
    Close ``nc`` to the end, even if the caller is cancelled meanwhile

    nats-py closes the socket last, after flushing and stopping its tasks
    (nats/aio/client.py, ``Client._close``), so a close cancelled halfway leaves the
    socket open. A cancellation that arrives meanwhile is raised once the close is done;
    a close that fails or takes longer than ``timeout_s`` is given up quietly.
    """
    if nc.is_closed:
        return
    closing = asyncio.ensure_future(asyncio.wait_for(nc.close(), timeout_s))
    cancelled = False
    while not closing.done():
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            if closing.cancelled():  # the loop itself is going away
                raise
            cancelled = True
        except (nats.errors.Error, OSError, TimeoutError):
            pass  # a failed close adds nothing
    if cancelled:
        raise asyncio.CancelledError


def error_text(err: BaseException) -> str:
    """``err``'s text without the ``nats: `` that nats-py's errors begin with"""
    return str(err).removeprefix("nats: ")


def permissions_violation(err: BaseException | None) -> bool:
    """
    Whether ``err`` is the server's refusal of one subject to this user: ``-ERR
    'Permissions Violation for Publish to ...'`` (or Subscription); the connection stays up
    """
    return err is not None and "permissions violation" in str(err).lower()


def credentials_refused(err: BaseException | None) -> str | None:
    """The server's reason if ``err`` says that it refused the credentials, else ``None``"""
    if isinstance(err, nats.errors.AuthorizationError):
        return _REFUSALS[0]
    if not isinstance(err, nats.errors.Error):
        return None
    text = str(err).lower()
    return next((reason for reason in _REFUSALS if reason in text), None)


# --------------------------------------------------------------------------- buckets
# A provisioned KV bucket is bound, never made: a missing one names the fix


async def bind_bucket(js: JetStreamContext, bucket: str, what: str) -> KeyValue:
    """
    The KV bucket ``bucket``, which ``cobald-remote broker init`` provisions

    :param what: the bucket's role in the error text, e.g. ``"handshake"``
    :raises HandshakeError: if the bucket does not exist
    """
    try:
        return await patiently(lambda: js.key_value(bucket))
    except nats.js.errors.BucketNotFoundError as err:
        raise HandshakeError(
            f"{what} bucket {bucket!r} does not exist: run 'cobald-remote broker init'"
        ) from err
