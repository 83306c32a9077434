"""docs/protocol.md: the bootstrap vectors are current, and check out without their generator"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from typing import Any

import msgpack
import nacl.signing
import nkeys
import pytest
from support import bootstrap_vectors as bv

from broker.server.auth.authority import Authority
from broker.server.auth.credentials import drone_jwt
from broker.server.auth.jwt import decode_jwt, public_of
from remote_agent.protocol import bootstrap as bs
from remote_agent.protocol.events import encode, to_json
from remote_agent.protocol.names import Namespace

_BLOCK = r"```{}\n(.*?)\n```"
_VECTOR = re.compile(
    r"#### Bootstrap `(\w+)`[^\n]*\n\n"
    r"(?:Signing input \(UTF-8\):\n\n```text\n(.*?)\n```\n\n"
    r"Signature \(ed25519, hex\):\n\n```signature\n([0-9a-f\n]+)```\n\n)?"
    r"Message \(MessagePack, hex\):\n\n```msgpack\n([0-9a-f\n]+)```\n\n```json\n(.*?)\n```",
    re.S,
)
_REFUSAL_ROW = re.compile(r"^\| .+ \| `(\w+)`(?:; `(\w+)`)? \| (yes|no)(?:; (yes|no))? \|$", re.M)


def _section() -> str:
    text = bv.DOC.read_text()
    return text[text.index(bv.BEGIN) : text.index(bv.END) + len(bv.END)]


def _keys() -> dict[str, str]:
    found = re.search(_BLOCK.format("json"), _section(), re.S)
    assert found is not None
    keys: dict[str, str] = json.loads(found[1])
    return keys


def _vectors() -> list[tuple[str, str, bytes, bytes, Any]]:
    return [
        (
            kind,
            signed,
            bytes.fromhex(sig.replace("\n", "")),
            bytes.fromhex(hexdump.replace("\n", "")),
            json.loads(value),
        )
        for kind, signed, sig, hexdump, value in _VECTOR.findall(_section())
    ]


def _as_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dt.datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


def test_the_section_is_current() -> None:
    assert _section() == bv.render(), "run: python tests/support/bootstrap_vectors.py"


def test_every_bootstrap_message_has_a_vector() -> None:
    assert [kind for kind, *_ in _vectors()] == ["enroll", "renew", "issued", "issue_refused"]


def test_the_documented_keys_belong_together() -> None:
    keys = _keys()
    drone = nkeys.from_seed(bytearray(keys["drone_seed"].encode()))
    assert public_of(drone) == keys["drone_public_key"]
    assert bs.token_hash(keys["token"]) == keys["token_sha256"]
    assert len(base64.urlsafe_b64decode(keys["token"] + "=")) == bs.TOKEN_BYTES


@pytest.mark.parametrize("vector", [v for v in _vectors() if v[1]], ids=lambda v: v[0])
def test_each_request_is_signed_by_the_documented_seed(
    vector: tuple[str, str, bytes, bytes, Any],
) -> None:
    kind, signed, signature, data, _ = vector
    keys = _keys()
    raw = base64.b32decode(keys["drone_seed"] + "=" * (-len(keys["drone_seed"]) % 8))
    private = nacl.signing.SigningKey(raw[2:34])  # two prefix bytes, the seed, a CRC-16
    assert private.sign(signed.encode()).signature == signature
    request = bs.decode_bootstrap_request(data)
    assert request.signature == signature
    assert bs.request_signing_input(request) == signed.encode()
    assert signed == (
        f"cobald-remote {kind} {request.site} {request.drone} {keys['drone_public_key']} "
        f"{(request.at - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)}"
    )
    assert bs.signature_valid(request.public_key, signed.encode(), signature)
    assert not bs.signature_valid(request.public_key, signed.encode() + b" ", signature)


@pytest.mark.parametrize("vector", _vectors(), ids=lambda v: v[0])
def test_both_decoders_read_the_documented_value(
    vector: tuple[str, str, bytes, bytes, Any],
) -> None:
    kind, _, _, data, value = vector
    reference = msgpack.unpackb(data, timestamp=3, strict_map_key=True)
    assert reference["kind"] == kind
    assert _as_json(reference) == value
    decode = (
        bs.decode_bootstrap_request if kind in ("enroll", "renew") else bs.decode_bootstrap_reply
    )
    message = decode(data)
    assert json.loads(to_json(message)) == value
    assert encode(message) == data


def test_the_issued_jwt_is_what_the_issuer_signs_for_the_drone() -> None:
    keys = _keys()
    issued = bs.decode_bootstrap_reply(next(v[3] for v in _vectors() if v[0] == "issued"))
    assert isinstance(issued, bs.Issued)
    documented = decode_jwt(issued.jwt)
    assert documented["exp"] == int(issued.expires.timestamp())
    signer = nkeys.from_seed(bytearray(keys["account_signing_seed"].encode()))
    assert documented["iss"] == public_of(signer)
    head, body, signature = issued.jwt.split(".")
    assert signer.verify(f"{head}.{body}".encode(), base64.urlsafe_b64decode(signature + "=="))
    fresh = decode_jwt(
        drone_jwt(
            _authority(keys),
            Namespace(),
            bv.SITE,
            bv.DRONE,
            keys["drone_public_key"],
            valid_for_s=bv.JWT_VALID_S,
        )
    )
    times = ("iat", "exp", "jti")
    assert {k: v for k, v in documented.items() if k not in times} == {
        k: v for k, v in fresh.items() if k not in times
    }
    assert documented["exp"] - documented["iat"] == fresh["exp"] - fresh["iat"]


def _authority(keys: dict[str, str]) -> Authority:
    """An authority with the documented signing key (the other seeds play no part)"""
    account = nkeys.encode_seed(bytes(range(96, 128)), nkeys.PREFIX_BYTE_ACCOUNT).decode()
    assert public_of(nkeys.from_seed(bytearray(account.encode()))) == keys["account_public_key"]
    return Authority(
        operator=nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_OPERATOR).decode(),
        account=account,
        account_signing=keys["account_signing_seed"],
        system=nkeys.encode_seed(bytes(range(1, 33)), nkeys.PREFIX_BYTE_ACCOUNT).decode(),
    )


def test_the_refusal_table_gives_every_reason_and_whether_it_is_permanent() -> None:
    text = bv.DOC.read_text()
    table = text[text.index("**The issuer's checks**") : text.index("An agent gives up")]
    documented: dict[str, set[bool]] = {}
    for first, second, yes1, yes2 in _REFUSAL_ROW.findall(table):
        documented.setdefault(first, set()).add(yes1 == "yes")
        if second:
            documented.setdefault(second, set()).add(yes2 == "yes")
    assert documented == {r.value: {r.permanent} for r in bs.Refusal}
