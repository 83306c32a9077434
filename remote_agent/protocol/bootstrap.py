"""
The bootstrap exchange: a drone trades its one-time token, then its own key, for a user JWT

A drone sends :class:`EnrollRequest` (once, with the token TARDIS put into its job) and
later :class:`RenewRequest` (before its JWT expires) to the issuer on
``<prefix>.bootstrap.<site>``, over the site's bootstrap identity. Both are signed with
the drone's own user key (:func:`signing_input`), so the issuer signs a JWT only for a
key whose holder asked for it; the answer is :class:`Issued` or :class:`IssueRefused`.
The reply holds a JWT and no secret: whoever reads it cannot connect without the seed,
which never leaves the drone.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import enum
import hashlib
import secrets
from typing import Annotated, Final

import msgspec
import nacl.exceptions
import nacl.signing
import nkeys

from remote_agent.protocol.codec import Codec
from remote_agent.protocol.events import AnyMessage, Message
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE, Seconds, Token, UtcTime, check_tokens

#: bytes of randomness in a bootstrap token
TOKEN_BYTES: Final = 32
#: the largest bootstrap request or reply the issuer or an agent reads
MAX_BOOTSTRAP_MESSAGE: Final = 8 * 1024
#: the environment variable the token reaches the drone in (TARDIS adds ``TardisDrone``)
TOKEN_ENV_KEY: Final = "CobaldRemoteToken"

_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

#: a user public key as nkeys spells it: ``U`` and 55 more base32 characters
PublicKey = Annotated[str, msgspec.Meta(pattern=r"^U[A-Z2-7]{55}\Z")]
Signature = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]


class _Request(Message, frozen=True, kw_only=True):
    site: Token
    drone: Token
    #: the drone's own user public key, which the JWT is for
    public_key: PublicKey
    #: when the drone signed the request
    at: UtcTime
    #: ed25519 signature by ``public_key`` over :func:`signing_input`
    signature: Signature

    def __post_init__(self) -> None:
        check_tokens(self, ("site", "drone"))


class EnrollRequest(_Request, frozen=True, kw_only=True, tag="enroll"):
    """The drone's first request: its one-time token and its new public key"""

    #: as long as a subject token may be; its characters are not checked here: the
    #: issuer compares it with the hashes it keeps, and a token it never minted is refused
    token: Token


class RenewRequest(_Request, frozen=True, kw_only=True, tag="renew"):
    """A new JWT for the key the drone enrolled with"""


class Issued(Message, frozen=True, kw_only=True, tag="issued"):
    """
    The issuer's answer: a user JWT for the request's key, valid until ``expires``

    ``expires`` is by the issuer's clock; an agent renews by ``valid_s``, counted on its
    own monotonic clock from the answer, so a drone whose clock is wrong renews in time.
    """

    jwt: Annotated[str, msgspec.Meta(max_length=MAX_BOOTSTRAP_MESSAGE)]
    expires: UtcTime
    #: seconds the JWT is valid from when it was issued (``None``: not said; the agent
    #: then takes ``expires`` against its own clock)
    valid_s: Seconds | None = None


class Refusal(enum.StrEnum):
    """Why the issuer refused a request; the agent gives up on the permanent ones"""

    MALFORMED = "malformed"  #: not a bootstrap request at all
    FORGED = "forged"  #: the signature does not match, or the token is not the drone's
    UNKNOWN = "unknown"  #: no token was minted for this drone
    REUSED = "reused"  #: the token was used already, by another key
    EXPIRED = "expired"  #: the token expired before its first use
    ENDED = "ended"  #: the drone has ended: it gets no new identity
    REVOKED = "revoked"  #: an operator revoked the drone
    #: reserved: not sent by this project's issuer, which does not judge a drone's clock;
    #: an agent asks again
    STALE = "stale"
    THROTTLED = "throttled"  #: too many requests from the site: try again later
    UNAVAILABLE = "unavailable"  #: the issuer cannot decide now: try again later

    @property
    def permanent(self) -> bool:
        """Whether asking again cannot succeed"""
        return self not in _TRANSIENT


_TRANSIENT: Final = frozenset({Refusal.STALE, Refusal.THROTTLED, Refusal.UNAVAILABLE})


class IssueRefused(Message, frozen=True, kw_only=True, tag="issue_refused"):
    reason: Refusal
    error: str = ""


AnyBootstrapRequest = EnrollRequest | RenewRequest
AnyBootstrapReply = Issued | IssueRefused

#: every message type of the protocol: the lifecycle's (events.AnyMessage) and the bootstrap's
AnyWireMessage = AnyMessage | AnyBootstrapRequest | AnyBootstrapReply

_wire = Codec[AnyWireMessage](AnyWireMessage, "message")
_requests = Codec[AnyBootstrapRequest](AnyBootstrapRequest, "bootstrap request")
_replies = Codec[AnyBootstrapReply](AnyBootstrapReply, "bootstrap reply")


def decode_any(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> AnyWireMessage:
    """
    Decode any message type of the protocol, the bootstrap's included

    :raises SchemaError: as :func:`~remote_agent.protocol.events.decode`
    """
    return _wire.decode(data, max_size)


def decode_bootstrap_request(data: bytes) -> AnyBootstrapRequest:
    """:raises SchemaError: for anything but a well-formed request"""
    return _requests.decode(data, MAX_BOOTSTRAP_MESSAGE)


def decode_bootstrap_reply(data: bytes) -> AnyBootstrapReply:
    """:raises SchemaError: for anything but a well-formed reply"""
    return _replies.decode(data, MAX_BOOTSTRAP_MESSAGE)


# --------------------------------------------------------------------------- signing


def signing_input(kind: str, site: str, drone: str, public_key: str, at: dt.datetime) -> bytes:
    """
    What a request's signature covers: ``cobald-remote <kind> <site> <drone> <key> <at>``

    ``at`` in integer microseconds since the epoch; ``kind`` is the request's tag.
    """
    at_us = (at - _EPOCH) // dt.timedelta(microseconds=1)
    return f"cobald-remote {kind} {site} {drone} {public_key} {at_us}".encode()


def request_signing_input(request: AnyBootstrapRequest) -> bytes:
    """:func:`signing_input` of a decoded request"""
    kind = request.__struct_config__.tag
    assert isinstance(kind, str)
    return signing_input(kind, request.site, request.drone, request.public_key, request.at)


def signature_valid(public_key: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the ed25519 signature by the user key ``public_key`` of ``data``"""
    try:
        raw = base64.b32decode(public_key.encode() + b"=" * (-len(public_key) % 8))
    except (binascii.Error, ValueError):
        return False
    # the prefix byte of a user key, 32 bytes of key, a CRC-16 (nkeys' encoding)
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER:
        return False
    if nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        return False
    try:
        nacl.signing.VerifyKey(raw[1:33]).verify(data, signature)
    except (nacl.exceptions.BadSignatureError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- tokens


def new_token() -> str:
    """A new bootstrap token: :data:`TOKEN_BYTES` random bytes, URL-safe base64"""
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_hash(token: str) -> str:
    """What the issuer stores of a token: its SHA-256, hex"""
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_match(token: str, stored_hash: str) -> bool:
    """Whether ``token`` is the one whose hash is ``stored_hash`` (constant time)"""
    return secrets.compare_digest(token_hash(token), stored_hash)
