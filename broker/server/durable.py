"""
The manager's durable consumer on the event stream: its configuration and provisioning

Its rule: :func:`ensure_consumer` creates it or brings its limits up to date on every
start, and refuses one of the same name that delivers something else.
"""

from __future__ import annotations

from typing import Final

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from broker.errors import ConsumerError
from remote_agent.protocol.transient import patiently

#: name of the manager's durable consumer on the event stream
DEFAULT_DURABLE: Final = "cobald-registry"
#: deliveries of one message to the durable before the server gives up on it
#: (see :func:`durable_config`)
MAX_DELIVER: Final = 5


def durable_config(
    filter_subject: str,
    name: str = DEFAULT_DURABLE,
    *,
    ack_wait_s: float = 30.0,
    max_ack_pending: int = 20_000,
    max_deliver: int = MAX_DELIVER,
    replicas: int | None = None,
) -> ConsumerConfig:
    """
    The manager's durable pull consumer: explicit acks, starting with new messages

    It starts at the moment it is first created; everything older comes from
    the registry's rebuild, which also runs on every start. ``max_ack_pending``
    is well above two pull batches so that acks in flight never stall delivery:
    the pull loop answers every message it is handed (a handler that raises
    terminates it), so only the 1.5 batches a consumer can be owed are ever
    unacknowledged, whatever the messages contain.

    ``max_deliver`` bounds how often one message is delivered. A message goes
    out again only when no answer came within ``ack_wait``: the manager died
    or lost its connection before its acks were written. Five deliveries
    survive four such failures in a row within the same batch; a message that
    kills the manager every time (a crash, not an exception) stops after five
    restarts instead of circulating forever. A message given up on is not
    lost to the registry: the rebuild on the next start reads the stream
    itself, and each drone's next heartbeat carries its whole state.
    """
    return ConsumerConfig(
        durable_name=name,
        name=name,
        description="cobald-remote drone registry",
        deliver_policy=DeliverPolicy.NEW,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        max_deliver=max_deliver,
        filter_subject=filter_subject,
        num_replicas=replicas,
    )


#: fields whose difference from the wanted config is a conflict, not drift
_IDENTITY_FIELDS: Final = ("deliver_policy", "ack_policy", "filter_subject")


async def ensure_consumer(
    js: JetStreamContext, stream: str, config: ConsumerConfig
) -> ConsumerInfo:
    """
    Create the durable consumer, or confirm the existing one; safe to call on every start

    The server accepts a create with the same configuration as a no-op and
    updates the fields it may update in place (``ack_wait``, ``max_ack_pending``,
    ``max_deliver``, ...; a create without ``action`` is "create or update",
    nats-server server/consumer.go:180, 1122-1144, and the fields that can not
    change are listed in ``checkNewConsumerConfig``, consumer.go:2535-2601), so
    a durable provisioned by an older manager gets the current limits.

    :raises ConsumerError: if a consumer of that name exists with another
        delivery policy, ack policy or filter, or the server refuses it
    """
    name = config.durable_name or config.name or ""
    try:
        info = await patiently(lambda: js.consumer_info(stream, name))
    except nats.js.errors.NotFoundError:
        info = None
    except nats.js.errors.APIError as err:
        raise ConsumerError(f"cannot look up consumer {name!r} on {stream!r}: {err}") from err
    if info is not None:
        conflicts = [
            f"{field_name} is {getattr(info.config, field_name)!r}, "
            f"not {getattr(config, field_name)!r}"
            for field_name in _IDENTITY_FIELDS
            if getattr(info.config, field_name) != getattr(config, field_name)
        ]
        if conflicts:
            raise ConsumerError(
                f"consumer {name!r} on stream {stream!r} exists with another configuration "
                f"({'; '.join(conflicts)}): delete it (nats consumer rm {stream} {name}) "
                "or configure another consumer name"
            )
    try:
        # the same configuration again is no error: a retry after a transient failure
        return await patiently(lambda: js.add_consumer(stream, config))
    except nats.js.errors.APIError as err:
        raise ConsumerError(
            f"the server refused consumer {name!r} on stream {stream!r}: {err.description} "
            f"(code {err.code}, err_code {err.err_code})"
        ) from err
