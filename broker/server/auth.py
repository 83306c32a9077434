"""
Per-drone NATS credentials: decentralized JWT authentication (operator mode)

NATS can confine each connection to the subjects its user JWT allows. With
one user per drone, a drone's credentials can publish only its own events and
write only its own handshake record, so a compromised or confused drone
cannot speak for another: the server refuses it before the registry's sender
check ever sees it.

:func:`create_authority` makes the keys once: an operator, the account all of
cobald-remote lives in (with a signing key that mints users), and the system
account nats-server needs. It returns the server configuration to include
(operator JWT, memory resolver with both account JWTs preloaded). The
authority file holds the seeds: keep it where the manager runs, readable only
by it. :func:`drone_credentials` mints one drone's ``.creds`` file with the
permissions of ``docs/agent.md``, :func:`manager_credentials` the manager's
(everything in the account), :func:`leaf_credentials` a site leaf node's.
The commands note every user they issue (:func:`note_issued`), so that
:func:`revoke` can name a drone's users in the account JWT's revocations;
servers take that on a configuration reload.

JWTs follow nats-io/jwt v2 (``docs/deployment.md``, checked against a real
nats-server in ``tests/integration/test_auth.py``): base64url without padding
of the header ``{"typ":"JWT","alg":"ed25519-nkey"}``, of the claims, and of the
issuer's ed25519 signature over ``header.claims``; ``jti`` is the base32 of
the SHA-512/256 of the claims.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import nkeys

from broker.errors import BrokerError
from remote_agent.protocol.events import EVENT_TYPES, kind_of
from remote_agent.protocol.limits import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import (
    Namespace,
    check_token,
    direct_get,
    inbox_prefix,
    kv_write_prefix,
)

#: how long a drone's credentials are valid by default (a drone lives hours to days)
DEFAULT_DRONE_VALIDITY_S: Final = 7 * 24 * 3600
_HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
_UNLIMITED: Final = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
}
_SYSTEM_LIMITS: Final = {
    key: value for key, value in _UNLIMITED.items() if key not in ("mem_storage", "disk_storage")
}
#: the connection type of a client connection (nats-io/jwt ``ConnectionTypeStandard``)
_STANDARD: Final = "STANDARD"


@dataclass(frozen=True, slots=True)
class AccountLimits:
    """
    What nats-server enforces for the whole cobald-remote account

    Defaults and why: ``docs/deployment.md#limits``. ``-1`` is "no limit".

    :param disk_bytes: JetStream file storage of every stream together, counted
        once per replica: the event stream's cap times its replicas, and the bucket
    :param memory_bytes: JetStream memory storage (nothing of cobald-remote keeps
        a stream in memory)
    :param streams: streams in the account (the event stream and the bucket)
    :param consumers: consumers *per stream*: the manager's durable and the
        ephemeral ones of its rebuild and record watch, of ``status`` and ``timeline``
    :param connections: client connections in the account (one per drone, the
        manager, the operator's commands)
    :param leaf_nodes: leaf node connections into the account (one per site)
    """

    disk_bytes: int = 16 * 1024**3
    memory_bytes: int = 0
    streams: int = 8
    consumers: int = 100
    connections: int = 50_000
    leaf_nodes: int = 256

    def claims(self) -> dict[str, Any]:
        """The ``limits`` of the account JWT"""
        return {
            **_UNLIMITED,
            "conn": self.connections,
            "leaf": self.leaf_nodes,
            "disk_storage": self.disk_bytes,
            "mem_storage": self.memory_bytes,
            "streams": self.streams,
            "consumer": self.consumers,
        }


@dataclass(frozen=True, slots=True)
class DroneLimits:
    """
    What nats-server enforces for one drone's connection (``docs/deployment.md#limits``)

    :param subscriptions: subscriptions at once; the agent holds three (its
        command subject, its record hint, the inbox of its requests)
    :param payload_bytes: largest message, headers included; a larger one
        closes the connection. The streams' size limit plus room for headers.
    """

    subscriptions: int = 16
    payload_bytes: int = DEFAULT_MAX_SIZE + 4096

    def claims(self) -> dict[str, Any]:
        """The limits of the user JWT (``data`` is not enforced by nats-server)"""
        return {
            "subs": self.subscriptions,
            "data": -1,
            "payload": self.payload_bytes,
            "allowed_connection_types": [_STANDARD],
        }


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


class AuthError(BrokerError):
    """Keys or credentials cannot be made or read"""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _key(seed: str) -> nkeys.KeyPair:
    return nkeys.from_seed(seed.encode())


def _public(key: nkeys.KeyPair) -> str:
    public: bytes = key.public_key
    return public.decode()


def _seed(key: nkeys.KeyPair) -> str:
    seed: bytes = key.seed
    return seed.decode()


def encode_jwt(claims: Mapping[str, Any], issuer: nkeys.KeyPair) -> str:
    """Sign ``claims`` (without ``iss``/``jti``, which are added) as a NATS JWT"""
    body = {**claims, "iss": _public(issuer)}
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


@dataclass(frozen=True, slots=True)
class Authority:
    """The seeds that make and sign everything (keep the file secret)"""

    operator: str
    account: str
    account_signing: str
    system: str
    name: str = "cobald-remote"
    #: when the authority was made (epoch s): the operator JWT's issue time, so that
    #: the server configuration made again later has the same operator, which a
    #: running nats-server requires to reload it
    issued_at: int = 0
    #: revoked user public keys -> epoch s: their credentials issued until then are refused
    revocations: Mapping[str, int] = field(default_factory=dict)
    #: what the servers enforce for the whole account (in its JWT)
    limits: AccountLimits = field(default_factory=AccountLimits)

    @property
    def account_public(self) -> str:
        return _public(_key(self.account))

    def server_config(self) -> str:
        """
        The nats-server configuration of operator mode for this authority

        The same authority always gives the same text; a revocation changes only
        the account JWT, so servers take it on a configuration reload.
        """
        operator, account, system = _key(self.operator), _key(self.account), _key(self.system)
        issued = self.issued_at
        account_claims: dict[str, Any] = {
            "type": "account",
            "version": 2,
            "default_permissions": {"pub": {}, "sub": {}},
            "signing_keys": [_public(_key(self.account_signing))],
            "limits": self.limits.claims(),
        }
        if self.revocations:
            account_claims["revocations"] = dict(sorted(self.revocations.items()))
        operator_jwt = encode_jwt(
            {
                "iat": issued,
                "sub": _public(operator),
                "name": self.name,
                "nats": {"type": "operator", "version": 2, "system_account": _public(system)},
            },
            operator,
        )
        accounts = {
            _public(account): encode_jwt(
                {
                    "iat": max([issued, *self.revocations.values()]),
                    "sub": _public(account),
                    "name": self.name,
                    "nats": account_claims,
                },
                operator,
            ),
            _public(system): encode_jwt(
                {
                    "iat": issued,
                    "sub": _public(system),
                    "name": "SYS",
                    # nats-server refuses JetStream on the system account
                    "nats": {"type": "account", "version": 2, "limits": _SYSTEM_LIMITS},
                },
                operator,
            ),
        }
        preload = "\n".join(f"  {public}: {jwt}" for public, jwt in accounts.items())
        return (
            f"# cobald-remote authority {self.name!r}: operator mode, accounts preloaded\n"
            f"operator: {operator_jwt}\n"
            f"system_account: {_public(system)}\n"
            "resolver: MEMORY\n"
            f"resolver_preload: {{\n{preload}\n}}\n"
        )

    def _user(
        self,
        name: str,
        permissions: Mapping[str, Any],
        valid_for_s: float | None,
        limits: Mapping[str, Any] | None = None,
    ) -> str:
        user = _new_key(nkeys.PREFIX_BYTE_USER)
        now = int(time.time())
        claims: dict[str, Any] = {
            "iat": now,
            "sub": _public(user),
            "name": name,
            "nats": {
                "type": "user",
                "version": 2,
                "subs": -1,
                "data": -1,
                "payload": -1,
                **(limits or {}),
                "issuer_account": self.account_public,
                **permissions,
            },
        }
        if valid_for_s is not None:
            claims["exp"] = now + int(valid_for_s)
        jwt = encode_jwt(claims, _key(self.account_signing))
        return _CREDS.format(jwt=jwt, seed=_seed(user))


def create_authority(name: str = "cobald-remote", limits: AccountLimits | None = None) -> Authority:
    """New keys for an operator, the cobald-remote account (and its signing key), SYS"""
    return Authority(
        limits=limits or AccountLimits(),
        operator=_seed(_new_key(nkeys.PREFIX_BYTE_OPERATOR)),
        account=_seed(_new_key(nkeys.PREFIX_BYTE_ACCOUNT)),
        account_signing=_seed(_new_key(nkeys.PREFIX_BYTE_ACCOUNT)),
        system=_seed(_new_key(nkeys.PREFIX_BYTE_ACCOUNT)),
        name=name,
        issued_at=int(time.time()),
    )


def _authority_json(authority: Authority) -> str:
    return json.dumps(
        {
            "name": authority.name,
            "operator": authority.operator,
            "account": authority.account,
            "account_signing": authority.account_signing,
            "system": authority.system,
            "issued_at": authority.issued_at,
            "revocations": dict(authority.revocations),
            "limits": asdict(authority.limits),
        },
        indent=2,
    )


def save_authority(authority: Authority, path: Path) -> None:
    """Write the seeds to ``path`` (mode 0600); refuses to overwrite"""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AuthError(
            f"{path} exists: an authority is made once (remove it to start over)"
        ) from None
    except OSError as err:
        raise AuthError(f"cannot write {path}: {err.strerror}") from err
    with os.fdopen(fd, "w") as out:
        out.write(_authority_json(authority) + "\n")


def update_authority(authority: Authority, path: Path) -> None:
    """Replace the authority file at ``path`` (mode 0600) in one step"""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(_authority_json(authority) + "\n")
        os.replace(temporary, path)
    except OSError as err:
        raise AuthError(f"cannot write {path}: {err.strerror}") from err


def load_authority(path: Path) -> Authority:
    """:raises AuthError: if ``path`` is missing or not an authority file"""
    try:
        values = json.loads(path.read_text())
        if "limits" in values:
            values["limits"] = AccountLimits(**values["limits"])
        authority = Authority(**values)
        for seed in (authority.operator, authority.account, authority.account_signing):
            _key(seed)
    except OSError as err:
        raise AuthError(f"cannot read {path}: {err.strerror}") from err
    except (ValueError, TypeError, nkeys.NkeysError) as err:
        raise AuthError(f"{path} is not a cobald-remote authority file: {err}") from err
    return authority


def drone_permissions(
    namespace: Namespace, site: str, drone: str, domain: str | None = None
) -> dict[str, Any]:
    """
    What one drone's agent may publish and subscribe (``docs/agent.md``)

    Its own events, one subject per event kind (not a wildcard: a drone
    cannot make up subjects, each of which the event stream would keep up to
    its per-subject cap); its own handshake record (direct-get reads,
    compare-and-set writes, and the core subscription it uses as a hint); its
    command subject (answering each request once); its own inboxes. With a
    JetStream ``domain`` (behind a leaf node) the record subjects carry the
    domain prefix.
    """
    check_token(site, "site")
    check_token(drone, "drone uuid")
    bucket = namespace.record_bucket
    key = namespace.record_key(site, drone)
    return {
        "pub": {
            "allow": [
                *(namespace.event(site, drone, kind_of(kind)) for kind in EVENT_TYPES),
                kv_write_prefix(bucket, domain) + key,
                direct_get(bucket, key, domain),
            ]
        },
        "sub": {
            "allow": [
                namespace.command(site, drone),
                namespace.record_subject(site, drone),
                f"{inbox_prefix(drone)}.>",
            ]
        },
        "resp": {"max": 1, "ttl": 0},
    }


def drone_credentials(
    authority: Authority,
    namespace: Namespace,
    site: str,
    drone: str,
    *,
    domain: str | None = None,
    valid_for_s: float | None = DEFAULT_DRONE_VALIDITY_S,
    limits: DroneLimits | None = None,
) -> str:
    """A ``.creds`` file (text) for one drone, valid for ``valid_for_s`` seconds"""
    permissions = drone_permissions(namespace, site, drone, domain)
    limits = limits or DroneLimits()
    return authority._user(f"drone-{drone}", permissions, valid_for_s, limits.claims())


def manager_credentials(authority: Authority, name: str = "manager") -> str:
    """A ``.creds`` file (text) for the manager, operators and ``broker init``: no limits"""
    return authority._user(name, {}, None)


def leaf_credentials(authority: Authority, site: str) -> str:
    """
    A ``.creds`` file (text) for a site's leaf node connecting to the hub

    The leaf node checks its drones' own credentials itself (it includes the
    same server configuration); its connection to the hub carries all of
    them, so the user has no limits in the account, like the manager's. The
    leaf's remote also names the account (:attr:`Authority.account_public`).
    """
    check_token(site, "site")
    return authority._user(f"leaf-{site}", {}, None)


def creds_claims(text: str) -> dict[str, Any]:
    """The claims of the user JWT in a ``.creds`` file's text"""
    match = re.search(r"-----BEGIN NATS USER JWT-----\s*(\S+)", text)
    if match is None:
        raise AuthError("not a .creds file: no user JWT in it")
    return decode_jwt(match[1])


def issued_log(authority_path: Path) -> Path:
    """Where the commands note every user they issue: ``<authority>.issued.jsonl``"""
    return authority_path.with_name(f"{authority_path.stem}.issued.jsonl")


def note_issued(authority_path: Path, creds: str) -> None:
    """Append the user of ``creds`` (name, public key, issue and expiry time) to the log"""
    claims = creds_claims(creds)
    entry = {key: claims.get(key) for key in ("name", "sub", "iat", "exp")}
    log_path = issued_log(authority_path)
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as out:
            out.write(json.dumps(entry) + "\n")
    except OSError as err:
        raise AuthError(f"cannot write {log_path}: {err.strerror}") from err


def _issued(authority_path: Path) -> list[dict[str, Any]]:
    """Every entry of the issuance log (none if there is no log yet)"""
    log_path = issued_log(authority_path)
    try:
        lines = log_path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError as err:
        raise AuthError(f"cannot read {log_path}: {err.strerror}") from err
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn last line: the rest still counts
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def issued_users(authority_path: Path, name: str) -> list[str]:
    """The public keys of every user issued as ``name`` (or ``drone-<name>``)"""
    names = (name, f"drone-{name}")
    return [
        str(entry.get("sub")) for entry in _issued(authority_path) if entry.get("name") in names
    ]


def expired_users(authority_path: Path, now: float | None = None) -> set[str]:
    """The public keys of issued users whose credentials have expired"""
    now = time.time() if now is None else now
    return {
        str(entry.get("sub"))
        for entry in _issued(authority_path)
        if isinstance(entry.get("exp"), int) and entry["exp"] < now
    }


def revoke(
    authority: Authority,
    users: list[str],
    at: int | None = None,
    expired: Collection[str] = (),
) -> Authority:
    """
    The authority with ``users`` (public keys) revoked: their credentials issued
    until ``at`` (default now) are refused once the servers reload the new
    configuration (existing connections of theirs are closed)

    :param expired: users whose credentials expired: their revocations are
        dropped, as the server refuses them anyway (keeps the account JWT small)
    """
    for user in users:
        if not (user.startswith("U") and len(user) == 56 and user.isalnum()):
            raise AuthError(f"not a user public key: {user!r}")
    when = int(time.time()) if at is None else at
    kept = {user: t for user, t in authority.revocations.items() if user not in expired}
    return replace(authority, revocations={**kept, **dict.fromkeys(users, when)})
