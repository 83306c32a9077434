"""
The bootstrap grants: one per drone TARDIS submitted, in a KV bucket of the manager's own

A grant holds the hash of the drone's one-time token, when the token expires, and once
the drone enrolled, its public key. Its rule: every change is a compare-and-set on the
revision that was read, so of two uses of one token exactly one wins, whichever manager
process or restart sees them. Drones and bootstrap identities cannot read the bucket. A read
or write that fails transiently (:mod:`remote_agent.protocol.transient`) is made again; a
write is first compared with what the bucket holds then, as it may have been stored.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Final

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from remote_agent.protocol.bootstrap import PublicKey, new_token, token_hash
from remote_agent.protocol.codec import Codec
from remote_agent.protocol.connect import bind_bucket
from remote_agent.protocol.events import Message, encode
from remote_agent.protocol.fields import Token, UtcTime, check_tokens
from remote_agent.protocol.names import Namespace, kv_stream, kv_subjects
from remote_agent.protocol.ratelog import RateLimitedLog
from remote_agent.protocol.transient import TRANSIENT_BUDGET_S, Backoff, is_transient, patiently

_failures = RateLimitedLog(logging.getLogger("cobald.runtime.cobald_remote.issuer"))

#: tries of one compare-and-set before it gives up (each loses only to another writer)
_CAS_TRIES: Final = 8


class GrantError(Exception):
    """A grant could not be read or written"""


class Grant(Message, frozen=True, kw_only=True, tag="grant"):
    """One drone's bootstrap grant as the bucket stores it"""

    site: Token
    drone: Token
    #: SHA-256 (hex) of the one-time token; the token itself is stored nowhere
    token_hash: str
    minted_at: UtcTime
    token_expires: UtcTime
    #: the drone's own public key, set by its first successful enrollment
    public_key: PublicKey | None = None
    enrolled_at: UtcTime | None = None
    #: the expiry of the last JWT signed for it
    jwt_expires: UtcTime | None = None
    #: why an operator revoked it (``""``: not revoked)
    revoked: str = ""

    def __post_init__(self) -> None:
        check_tokens(self, ("site", "drone"))


_grants = Codec[Grant](Grant, "grant")


class GrantStore:
    """The grants bucket: mint, read, enroll, note renewals, revoke, purge"""

    def __init__(self, kv: KeyValue, js: JetStreamContext, namespace: Namespace) -> None:
        self._kv = kv
        self._js = js
        self._namespace = namespace

    @classmethod
    async def open(cls, js: JetStreamContext, namespace: Namespace) -> GrantStore:
        """:raises HandshakeError: if ``broker init`` has not made the bucket"""
        return cls(await bind_bucket(js, namespace.grant_bucket, "grants"), js, namespace)

    def _key(self, site: str, drone: str) -> str:
        return self._namespace.record_key(site, drone)  # the same ``<site>.<drone>`` rule

    async def get(self, site: str, drone: str) -> tuple[Grant, int] | None:
        """The drone's grant and its revision, ``None`` if it has none"""
        key = self._key(site, drone)
        try:
            entry = await patiently(lambda: self._kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        grant = _grants.decode(entry.value)  # only the manager writes the bucket
        if grant.site != site or grant.drone != drone:
            raise GrantError(f"the grant under {site}/{drone} names {grant.site}/{grant.drone}")
        return grant, entry.revision

    async def sites(self) -> set[str]:
        """The sites with at least one grant"""
        try:
            keys = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return set()
        return {key.partition(".")[0] for key in keys}

    @property
    def subjects(self) -> str:
        """The subjects every write to the bucket is published on: ``$KV.<bucket>.>``"""
        return kv_subjects(self._namespace.grant_bucket) + ">"

    async def mint(self, site: str, drone: str, valid_for_s: float, now: dt.datetime) -> str:
        """
        A new token for ``drone``, valid for ``valid_for_s``; only its hash is stored

        A drone that enrolled already, or was revoked, keeps its grant: the token returned
        then is one that no grant accepts (a second job with the drone's uuid bootstraps
        nothing).

        :raises GrantError: if the bucket cannot be written
        """
        token = new_token()
        grant = Grant(
            site=site,
            drone=drone,
            token_hash=token_hash(token),
            minted_at=now,
            token_expires=now + dt.timedelta(seconds=valid_for_s),
        )
        for _ in range(_CAS_TRIES):
            found = await self.get(site, drone)
            if found is not None and (found[0].public_key is not None or found[0].revoked):
                return new_token()
            if await self._put(grant, None if found is None else found[1]):
                return token
        raise GrantError(f"the grant of {site}/{drone} kept changing while minting")

    async def enroll(
        self, grant: Grant, revision: int, public_key: str, jwt_expires: dt.datetime
    ) -> bool:
        """Bind ``public_key`` to the grant read at ``revision``; ``False``: another write won"""
        enrolled = msgspec.structs.replace(
            grant,
            public_key=public_key,
            enrolled_at=dt.datetime.now(dt.UTC),
            jwt_expires=jwt_expires,
        )
        return await self._update(grant, enrolled, revision)

    async def renewed(self, grant: Grant, revision: int, jwt_expires: dt.datetime) -> bool:
        """Note the expiry of the JWT just signed; ``False``: another write won"""
        return await self._update(
            grant, msgspec.structs.replace(grant, jwt_expires=jwt_expires), revision
        )

    async def revoke(self, site: str, drone: str, reason: str) -> Grant | None:
        """
        Mark the drone's grant revoked: it is renewed no more. ``None``: it has none

        :raises GrantError: if the bucket cannot be written
        """
        for _ in range(_CAS_TRIES):
            found = await self.get(site, drone)
            if found is None:
                return None
            grant, revision = found
            revoked = msgspec.structs.replace(grant, revoked=reason or "revoked")
            if await self._update(grant, revoked, revision):
                return revoked
        raise GrantError(f"the grant of {site}/{drone} kept changing while revoking it")

    async def _update(self, grant: Grant, new: Grant, revision: int) -> bool:
        return await self._put(new, revision)

    async def _put(self, grant: Grant, revision: int | None) -> bool:
        """
        Create (``revision is None``) or compare-and-set ``grant``; ``False``: another write won

        :raises: the last transient error once the transient budget has passed
        """
        key, value = self._key(grant.site, grant.drone), encode(grant)
        deadline = time.monotonic() + TRANSIENT_BUDGET_S
        backoff = Backoff(first=0.05, most=1.0)
        while True:
            try:
                if revision is None:
                    await self._kv.create(key, value)
                else:
                    await self._kv.update(key, value, revision)
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                return False
            except Exception as err:
                if not is_transient(err) or time.monotonic() >= deadline:
                    raise
                _failures.warning(
                    "write failed", "write of grant %s failed, re-reading: %r", key, err
                )
            found = await self.get(grant.site, grant.drone)
            if found is not None and found[0] == grant:
                return True  # stored before the failure was seen
            if (None if found is None else found[1]) != revision:
                return False
            await asyncio.sleep(min(backoff.delay(), max(0.0, deadline - time.monotonic())))

    async def purge(self, site: str, drone: str) -> None:
        """Remove the drone's grant without a marker (its retirement)"""
        bucket = self._namespace.grant_bucket
        await self._js.purge_stream(
            kv_stream(bucket), subject=kv_subjects(bucket) + self._key(site, drone)
        )
