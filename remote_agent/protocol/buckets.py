"""Binding to a provisioned KV bucket: a missing one is a :class:`HandshakeError` naming the fix"""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.transient import patiently


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
