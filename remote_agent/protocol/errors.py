"""
Errors of the protocol that drone and manager share

::

    ProtocolError
    ├── SchemaError       a message or subject off the wire contract (also a ValueError)
    └── HandshakeError    the handshake record cannot be read or written
        └── RecordTampered    the record was deleted, purged or holds no valid record
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base for everything :mod:`remote_agent.protocol` raises on purpose"""


class SchemaError(ProtocolError, ValueError):
    """A message or subject that does not follow the wire contract"""


class HandshakeError(ProtocolError):
    """The handshake record could not be read or written"""


class RecordTampered(HandshakeError):
    """
    The record was deleted, purged, or holds no valid record

    Neither side wrote that: the manager never takes it for "never announced"
    (it does not release over it), the agent takes it for a closed gate.
    """
