"""
The log of every user the commands issue, and revoking users in the account JWT

Servers take a revocation on a configuration reload.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker.errors import AuthError
from broker.server.auth.authority import Authority
from broker.server.auth.jwt import creds_claims


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
