"""
The authority: the operator, account and system keys, their file, and the server configuration

The authority file holds the seeds: keep it where the manager runs, readable only by it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import nkeys

from broker.errors import AuthError
from broker.server.auth.jwt import encode_jwt, key_of, new_key, public_of, seed_of

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
        return public_of(key_of(self.account))

    def server_config(self) -> str:
        """
        The nats-server configuration of operator mode for this authority

        The same authority always gives the same text; a revocation changes only
        the account JWT, so servers take it on a configuration reload.
        """
        operator, account, system = key_of(self.operator), key_of(self.account), key_of(self.system)
        issued = self.issued_at
        account_claims: dict[str, Any] = {
            "type": "account",
            "version": 2,
            "default_permissions": {"pub": {}, "sub": {}},
            "signing_keys": [public_of(key_of(self.account_signing))],
            "limits": self.limits.claims(),
        }
        if self.revocations:
            account_claims["revocations"] = dict(sorted(self.revocations.items()))
        operator_jwt = encode_jwt(
            {
                "iat": issued,
                "sub": public_of(operator),
                "name": self.name,
                "nats": {"type": "operator", "version": 2, "system_account": public_of(system)},
            },
            operator,
        )
        accounts = {
            public_of(account): encode_jwt(
                {
                    "iat": max([issued, *self.revocations.values()]),
                    "sub": public_of(account),
                    "name": self.name,
                    "nats": account_claims,
                },
                operator,
            ),
            public_of(system): encode_jwt(
                {
                    "iat": issued,
                    "sub": public_of(system),
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
            f"system_account: {public_of(system)}\n"
            "resolver: MEMORY\n"
            f"resolver_preload: {{\n{preload}\n}}\n"
        )


def create_authority(name: str = "cobald-remote", limits: AccountLimits | None = None) -> Authority:
    """New keys for an operator, the cobald-remote account (and its signing key), SYS"""
    return Authority(
        limits=limits or AccountLimits(),
        operator=seed_of(new_key(nkeys.PREFIX_BYTE_OPERATOR)),
        account=seed_of(new_key(nkeys.PREFIX_BYTE_ACCOUNT)),
        account_signing=seed_of(new_key(nkeys.PREFIX_BYTE_ACCOUNT)),
        system=seed_of(new_key(nkeys.PREFIX_BYTE_ACCOUNT)),
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
    """Write the seeds to ``path`` (mode 0600), making its directory; refuses to overwrite"""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
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
    _replace_secret(path, _authority_json(authority))


def _replace_secret(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step, readable by its owner only"""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text + "\n")
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
            key_of(seed)
    except OSError as err:
        raise AuthError(f"cannot read {path}: {err.strerror}") from err
    except (ValueError, TypeError, nkeys.NkeysError) as err:
        raise AuthError(f"{path} is not a cobald-remote authority file: {err}") from err
    return authority


@dataclass(frozen=True, slots=True)
class IssuerKey:
    """
    What the issuer signs drone JWTs with: the account's signing seed and public key

    Its file (``auth issuer-key``) lets whoever reads it make users of the account, but
    holds neither the operator's nor the account's own seed: the authority file stays
    off the manager's host.
    """

    account_public: str
    account_signing: str


def issuer_key_of(authority: Authority) -> IssuerKey:
    return IssuerKey(authority.account_public, authority.account_signing)


def save_issuer_key(key: IssuerKey, path: Path) -> None:
    """Write the issuer's key to ``path`` (mode 0600) in one step"""
    text = json.dumps({"account": key.account_public, "account_signing": key.account_signing})
    _replace_secret(path, text)


def load_issuer_key(path: Path) -> IssuerKey:
    """
    The issuer's key from its file (``auth issuer-key``)

    :raises AuthError: if ``path`` is missing or holds no issuer key
    """
    try:
        values = json.loads(path.read_text())
        key = IssuerKey(str(values["account"]), str(values["account_signing"]))
        signing = key_of(key.account_signing)
        if not key.account_public.startswith("A") or not public_of(signing).startswith("A"):
            raise ValueError("not account keys")
    except OSError as err:
        raise AuthError(f"cannot read {path}: {err.strerror}") from err
    except (ValueError, TypeError, KeyError, nkeys.NkeysError) as err:
        raise AuthError(f"{path} is not a cobald-remote issuer key file: {err!r}") from err
    return key
