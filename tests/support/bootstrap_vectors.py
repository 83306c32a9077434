"""
Examples of the bootstrap messages with a fixed key, and their section of docs/protocol.md

The drone's user key, its token and the account signing key that signs its JWT
come from fixed bytes given in the document, and every time is fixed, so another
client can sign the same input and must get the same signature (ed25519 is
deterministic). ``python tests/support/bootstrap_vectors.py`` rewrites the section
between the markers; ``tests/unit/test_bootstrap_vectors.py`` checks that it is
current and checks each vector against the code without this module's help.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path
from typing import Any, Final

import msgspec
import nkeys

from broker.server.auth.credentials import DroneLimits, drone_permissions
from broker.server.auth.jwt import encode_jwt, public_of
from remote_agent.protocol import bootstrap as bs
from remote_agent.protocol.events import Message, encode, kind_of, to_json
from remote_agent.protocol.names import Namespace

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
BEGIN = "<!-- bootstrap-vectors:begin (generated; do not edit) -->"
END = "<!-- bootstrap-vectors:end -->"

SITE: Final = "site1"
DRONE: Final = "site1-0123456789"
#: the 32 bytes of the drone's user key (an nkeys user seed encodes them)
DRONE_KEY_BYTES: Final = bytes(range(32))
#: the 32 random bytes of the drone's one-time token
TOKEN_BYTES: Final = bytes(range(32, 64))
#: the 32 bytes of the account signing key that signs the drone's JWT
SIGNING_KEY_BYTES: Final = bytes(range(64, 96))
#: when the drone enrolled; it renews at half of its JWT's life
ENROLLED_AT: Final = dt.datetime(2026, 3, 18, 16, 0, 0, 123456, tzinfo=dt.UTC)
JWT_VALID_S: Final = 900
RENEWED_AT: Final = ENROLLED_AT + dt.timedelta(seconds=JWT_VALID_S / 2, microseconds=2_071)

DRONE_SEED: Final = nkeys.encode_seed(DRONE_KEY_BYTES, nkeys.PREFIX_BYTE_USER).decode()
SIGNING_SEED: Final = nkeys.encode_seed(SIGNING_KEY_BYTES, nkeys.PREFIX_BYTE_ACCOUNT).decode()
DRONE_KEY: Final = nkeys.from_seed(bytearray(DRONE_SEED.encode()))
PUBLIC_KEY: Final = public_of(DRONE_KEY)
#: the token as the manager mints it: URL-safe base64 without padding
TOKEN: Final = base64.urlsafe_b64encode(TOKEN_BYTES).rstrip(b"=").decode()
#: the account the JWT is of (``issuer_account``), from fixed bytes too
ACCOUNT: Final = public_of(
    nkeys.from_seed(nkeys.encode_seed(bytes(range(96, 128)), nkeys.PREFIX_BYTE_ACCOUNT))
)


def _signed(kind: str, at: dt.datetime) -> dict[str, Any]:
    data = bs.signing_input(kind, SITE, DRONE, PUBLIC_KEY, at)
    signature: bytes = DRONE_KEY.sign(data)
    return {
        "site": SITE,
        "drone": DRONE,
        "public_key": PUBLIC_KEY,
        "at": at,
        "signature": signature,
    }


def drone_jwt_claims(iat: int) -> dict[str, Any]:
    """The claims the issuer signs for the drone at ``iat`` (as ``drone_jwt`` makes them)"""
    return {
        "iat": iat,
        "exp": iat + JWT_VALID_S,
        "sub": PUBLIC_KEY,
        "name": f"drone-{DRONE}",
        "nats": {
            "type": "user",
            "version": 2,
            **DroneLimits().claims(),
            "issuer_account": ACCOUNT,
            **drone_permissions(Namespace(), SITE, DRONE),
        },
    }


def _issued(at: dt.datetime) -> bs.Issued:
    iat = int(at.timestamp())
    signer = nkeys.from_seed(bytearray(SIGNING_SEED.encode()))
    jwt = encode_jwt(drone_jwt_claims(iat), signer)
    return bs.Issued(
        jwt=jwt,
        expires=dt.datetime.fromtimestamp(iat + JWT_VALID_S, dt.UTC),
        valid_s=float(JWT_VALID_S),
    )


ENROLL = bs.EnrollRequest(**_signed("enroll", ENROLLED_AT), token=TOKEN)
RENEW = bs.RenewRequest(**_signed("renew", RENEWED_AT))
ISSUED = _issued(ENROLLED_AT)
REFUSED = bs.IssueRefused(reason=bs.Refusal.REUSED, error="the token was used")
EXAMPLES: Final[list[Message]] = [ENROLL, RENEW, ISSUED, REFUSED]

_TITLES: Final = {
    "enroll": "the drone's first request, with its token",
    "renew": "the same drone, half its JWT's life later",
    "issued": "the issuer's answer to the enrollment",
    "issue_refused": "the answer to another key presenting the same token",
}


def _wrap(text: str, width: int = 64) -> list[str]:
    return [text[i : i + width] for i in range(0, len(text), width)]


def _message(message: Message) -> list[str]:
    kind = kind_of(type(message))
    lines = [f"#### Bootstrap `{kind}`: {_TITLES[kind]}", ""]
    if isinstance(message, bs.EnrollRequest | bs.RenewRequest):
        signed = bs.request_signing_input(message)
        lines += [
            "Signing input (UTF-8):",
            "",
            "```text",
            signed.decode(),
            "```",
            "",
            "Signature (ed25519, hex):",
            "",
            "```signature",
            *_wrap(message.signature.hex()),
            "```",
            "",
        ]
    lines += ["Message (MessagePack, hex):", "", "```msgpack", *_wrap(encode(message).hex())]
    pretty = msgspec.json.format(to_json(message), indent=2).decode()
    return [*lines, "```", "", "```json", pretty, "```", ""]


def render() -> str:
    """The generated bootstrap section of docs/protocol.md"""
    key = {
        "drone_seed": DRONE_SEED,
        "drone_public_key": PUBLIC_KEY,
        "token": TOKEN,
        "token_sha256": bs.token_hash(TOKEN),
        "account_signing_seed": SIGNING_SEED,
        "account_public_key": ACCOUNT,
    }
    parts = [
        BEGIN,
        "",
        "The fixed keys and token of these vectors (never use them anywhere else):",
        "",
        "```json",
        json.dumps(key, indent=2),
        "```",
        "",
    ]
    for message in EXAMPLES:
        parts += _message(message)
    parts.append(END)
    return "\n".join(parts)


def update_doc() -> bool:
    """Rewrite the generated section; True if the document changed"""
    text = DOC.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render() + text[stop:]
    if new != text:
        DOC.write_text(new)
    return new != text


if __name__ == "__main__":
    print("updated" if update_doc() else "unchanged", DOC)
