"""
What ``release`` and ``drain`` check before they write a drone's record, and how their failures read

Their rule: a drone the manager has never heard of (no event in the stream, no
record in the bucket) is refused without ``--force``, since a typo would leave a
record of a drone that never existed; a refused permission says what to do in one line.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from broker.commands.options import refused
from broker.errors import OperatorError

if TYPE_CHECKING:
    from nats.aio.client import Client

    from broker.manager.control import Control


async def heard_of(nc: Client, control: Control, site: str, drone: str, domain: str | None) -> bool:
    """Whether the drone has a record (or had one) or any event in the stream"""
    from nats.js.errors import NotFoundError

    from remote_agent.protocol.errors import HandshakeError

    store = control.store
    try:
        if await store.read(site, drone) is not None or await store.removed(site, drone):
            return True
    except HandshakeError:  # a value is there, if not a valid record
        return True
    namespace = control.namespace
    js = nc.jetstream(domain=domain)
    try:
        info = await js.stream_info(
            namespace.event_stream, subjects_filter=namespace.drone_events(site, drone)
        )
    except NotFoundError:
        return False
    return bool(info.state.subjects)


async def refuse_unknown(
    nc: Client,
    control: Control,
    site: str,
    drone: str,
    *,
    domain: str | None,
    force: bool,
    command: str,
) -> None:
    """
    Refuse to act on a drone the manager has never heard of, unless ``force``

    :raises OperatorError: if it is unknown and ``force`` is not given
    """
    if await heard_of(nc, control, site, drone, domain):
        return
    what = f"{site}/{drone}: no event and no record of this drone"
    if not force:
        raise OperatorError(
            f"{what}: check the uuid (cobald-remote status), or give --force to {command} it anyway"
        )
    print(f"cobald-remote: warning: {what}; {command} it anyway (--force)", file=sys.stderr)


@contextlib.contextmanager
def permission_errors(nc: Client) -> Iterator[None]:
    """A request that timed out because the server refused its subject: one line saying so"""
    import nats.errors

    try:
        yield
    except (TimeoutError, nats.errors.Error) as err:
        if line := refused(nc):
            raise OperatorError(line) from None
        if isinstance(err, nats.errors.Error):
            raise OperatorError(f"{err}") from None
        raise OperatorError(f"no answer from the server: {err or 'timeout'}") from None
