"""
Strict decoding of one family of wire messages: size limit, schema version, error text

Every rejection is a :class:`~remote_agent.protocol.errors.SchemaError` that names what
went wrong, never the input itself.
"""

from __future__ import annotations

from typing import Any, Final, Generic, Protocol, TypeVar

import msgspec

from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE

#: major version of the wire schema written by this code and the only one it reads
SCHEMA_VERSION: Final = 1


class _Versioned(Protocol):
    @property
    def v(self) -> int: ...


T = TypeVar("T", bound=_Versioned)


class _Header(msgspec.Struct):
    """The fields needed to say *why* a message was rejected"""

    v: int = SCHEMA_VERSION
    kind: str = ""


_header_decoder = msgspec.msgpack.Decoder(_Header)


class Codec(Generic[T]):
    """A reusable strict decoder for one family of messages"""

    def __init__(self, target: Any, what: str) -> None:  # a type or a union of types
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(target)
        self.what = what

    def decode(self, data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> T:
        if len(data) > max_size:
            raise SchemaError(
                f"{self.what} of {len(data)} bytes exceeds the limit of {max_size} bytes"
            )
        try:
            message = self._decoder.decode(data)
        except msgspec.ValidationError as err:
            _raise_version_error(data)
            raise SchemaError(f"invalid {self.what}: {err}") from None
        except msgspec.DecodeError as err:
            raise SchemaError(f"malformed {self.what}: {err}") from None
        except Exception as err:  # e.g. RecursionError for deeply nested unknown fields
            raise SchemaError(f"malformed {self.what}: {describe_error(err)}") from None
        version = message.v
        if version != SCHEMA_VERSION:
            raise SchemaError(_version_text(self.what, version))
        return message


def _version_text(what: str, version: object) -> str:
    return f"unsupported {what} schema version {version!r} (this side speaks {SCHEMA_VERSION})"


def describe_error(err: BaseException) -> str:
    """
    What went wrong in decoding, for a rejection: never the input itself

    msgspec raises its own errors for what it understands, and Python's for
    the rest (``RecursionError`` past about a thousand levels of nesting,
    ``MemoryError``); every one of them is a rejection of the input.
    """
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return f"{type(err).__name__}: {err}"[:200]


def _raise_version_error(data: bytes) -> None:
    """Prefer "unknown version" over a field error when the version is the cause"""
    try:
        header = _header_decoder.decode(data)
    except Exception:  # the caller reports the field error instead
        return
    if header.v != SCHEMA_VERSION:
        raise SchemaError(_version_text("message", header.v))
