"""
NATS JWTs and ``.creds`` files (nats-io/jwt v2), and the nkeys they are signed with

A JWT is base64url without padding of the header, of the claims and of the
issuer's ed25519 signature over ``header.claims``; ``jti`` is the base32 of the
SHA-512/256 of the claims.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Final

import nkeys

from broker.errors import AuthError

_HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
_CREDS: Final = """-----BEGIN NATS USER JWT-----
{jwt}
------END NATS USER JWT------

************************* IMPORTANT *************************
NKEY Seed printed below can be used to sign and prove identity.
NKEYs are sensitive and should be treated as secrets.

-----BEGIN USER NKEY SEED-----
{seed}
------END USER NKEY SEED------

*************************************************************
"""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_key(prefix: int) -> nkeys.KeyPair:
    """A new key pair of the kind ``prefix`` (an ``nkeys.PREFIX_BYTE_*``)"""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def key_of(seed: str) -> nkeys.KeyPair:
    """The key pair of a seed"""
    return nkeys.from_seed(seed.encode())


def public_of(key: nkeys.KeyPair) -> str:
    """A key's public key (text)"""
    public: bytes = key.public_key
    return public.decode()


def seed_of(key: nkeys.KeyPair) -> str:
    """A key's seed (text)"""
    seed: bytes = key.seed
    return seed.decode()


def encode_jwt(claims: Mapping[str, Any], issuer: nkeys.KeyPair) -> str:
    """Sign ``claims`` (without ``iss``/``jti``, which are added) as a NATS JWT"""
    body = {**claims, "iss": public_of(issuer)}
    digest = hashlib.new("sha512_256", json.dumps(body, separators=(",", ":")).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    signature: bytes = issuer.sign(signing_input.encode())
    return f"{signing_input}.{_b64(signature)}"


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of a JWT (not verified: for reading what was issued)"""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError) as err:
        raise AuthError(f"not a JWT: {err}") from None
    if not isinstance(claims, dict):
        raise AuthError("not a JWT: the claims are not an object")
    return claims


def creds_file(jwt: str, seed: str) -> str:
    """The text of a ``.creds`` file: a user JWT and the user's seed"""
    return _CREDS.format(jwt=jwt, seed=seed)


def creds_claims(text: str) -> dict[str, Any]:
    """The claims of the user JWT in a ``.creds`` file's text"""
    match = re.search(r"-----BEGIN NATS USER JWT-----\s*(\S+)", text)
    if match is None:
        raise AuthError("not a .creds file: no user JWT in it")
    return decode_jwt(match[1])
