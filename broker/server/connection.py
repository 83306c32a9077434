"""Connections of the short-lived commands (``broker init``, ``drain``, ``status``, ...)"""

from __future__ import annotations

import logging
from collections.abc import Callable

import nats
import nats.errors
from nats.aio.client import Client

from broker.errors import ConnectError
from remote_agent.protocol.connect import connect, credentials_refused, error_text
from remote_agent.protocol.environment import split_urls

log = logging.getLogger("cobald.runtime.cobald_remote.connection")


async def connect_once(
    url: str,
    creds: str | None = None,
    *,
    name: str,
    on_error: Callable[[Exception], None] | None = None,
) -> Client:
    """
    Connect for a short-lived command: fail fast instead of retrying for minutes

    :param url: one NATS URL or several, comma-separated
    :param on_error: called with each error nats-py reports (its ``error_cb``)
    :raises ConnectError: if no server answers
    """

    async def quiet(err: Exception) -> None:  # the raised error says it once, clearly
        log.debug("nats: %s", error_text(err))
        if on_error is not None:
            on_error(err)

    try:
        return await connect(
            split_urls(url),  # nats-py does not split commas itself
            error_cb=quiet,
            user_credentials=creds,
            name=name,
            connect_timeout=2,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.2,
            allow_reconnect=False,
        )
    except (OSError, nats.errors.Error) as err:
        hint = ""
        if (reason := credentials_refused(err)) is not None:
            hint = (
                f": the server refused the credentials ({reason}); "
                "check --creds (a .creds file it trusts)"
            )
        raise ConnectError(f"cannot connect to {url}: {err}{hint}") from None
