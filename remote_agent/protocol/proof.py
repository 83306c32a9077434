"""
The manager's proof on the handshake records it writes: an HMAC under a key drones cannot read

The server lets a drone write any value to its own key; the proof tells the manager's
writes from a drone's. A ``released`` record without a valid proof releases nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from functools import partial
from typing import Final

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from remote_agent.protocol.connect import bind_bucket
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.events import DroneRecord, encode
from remote_agent.protocol.names import Namespace
from remote_agent.protocol.transient import patiently

#: key of the record proof key in :attr:`~remote_agent.protocol.events.Namespace.manager_bucket`
PROOF_KEY: Final = "record-proof-key"
#: bytes of a proof key
_PROOF_KEY_BYTES: Final = 32


def record_proof(key: bytes, record: DroneRecord) -> bytes:
    """The manager's proof of ``record``: HMAC-SHA256 of its encoding without a proof"""
    unsigned = msgspec.structs.replace(record, proof=b"")
    return hmac.new(key, encode(unsigned), hashlib.sha256).digest()


def proven(key: bytes | None, record: DroneRecord) -> bool:
    """Whether ``record`` carries the manager's valid proof under ``key``"""
    if key is None or not record.proof:
        return False
    return hmac.compare_digest(record.proof, record_proof(key, record))


async def load_proof_key(js: JetStreamContext, namespace: Namespace) -> bytes:
    """
    The manager's record proof key, made on first use (create-if-absent: every
    manager of the bus agrees on the first one made)

    :raises HandshakeError: if the manager bucket does not exist or cannot be read
    """
    kv = await bind_bucket(js, namespace.manager_bucket, "manager")
    for _ in range(3):
        try:
            entry = await patiently(lambda: kv.get(PROOF_KEY))
        except nats.js.errors.KeyNotFoundError:
            # another manager may make it first, or a create that failed transiently was
            # stored after all: then the next read finds that one
            with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                await patiently(partial(kv.create, PROOF_KEY, os.urandom(_PROOF_KEY_BYTES)))
            continue
        if entry.value is None or len(entry.value) != _PROOF_KEY_BYTES:
            raise HandshakeError(
                f"{PROOF_KEY!r} in {namespace.manager_bucket!r} is not a key of "
                f"{_PROOF_KEY_BYTES} bytes"
            )
        return entry.value
    raise HandshakeError(f"cannot read or make {PROOF_KEY!r} in {namespace.manager_bucket!r}")
