"""
The issuer: signs each bootstrapped drone a short-lived user JWT for its own key

It answers :mod:`remote_agent.protocol.bootstrap` requests on
``<prefix>.bootstrap.<site>`` (received by :mod:`broker.manager.issuer_thread`). Its rule:
a JWT is signed only for a request signed by the key it names, on its own site's subject,
for a drone with a grant that is not revoked and a drone that has not ended; an
enrollment needs the drone's unused, unexpired token and wins the grant by
compare-and-set, a renewal needs the key the grant holds. Every refusal is counted by
reason and logged (rate-limited) with the drone and the site it came from.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import nats.errors
from nats.aio.client import Client

from broker.manager.grants import Grant, GrantStore
from broker.manager.registry import Registry
from broker.manager.sitequeues import MAX_SITES
from broker.server.auth.authority import IssuerKey
from broker.server.auth.credentials import drone_jwt
from remote_agent.protocol.bootstrap import (
    AnyBootstrapRequest,
    EnrollRequest,
    Issued,
    IssueRefused,
    Refusal,
    decode_bootstrap_request,
    request_signing_input,
    signature_valid,
    tokens_match,
)
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import encode
from remote_agent.protocol.names import Namespace, bootstrap_inbox, is_token
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.issuer")

#: the queue group of the issuer's subscriptions: several managers share the requests
QUEUE: Final = "cobald-remote-issuer"
#: the count of one site's requests dropped unread, its queue full: ``queue_full:<site>``
QUEUE_FULL: Final = "queue_full:"
#: how long a bootstrap token is valid by default: a little over a long queue time
DEFAULT_TOKEN_VALID_S: Final = 3 * 24 * 3600.0
#: how long an issued JWT is valid by default; revocation takes effect within it
DEFAULT_JWT_VALID_S: Final = 900.0


@dataclass(frozen=True, slots=True)
class IssuerSettings:
    """
    The issuer's configuration (the ``bootstrap:`` section of the bus configuration)

    :param key: the issuer's key file (``auth issuer-key``): the account signing key
    :param token_valid_s: how long a minted token may wait for its drone to start
    :param jwt_valid_s: how long an issued JWT is valid; the agent renews it at half
    :param rate_per_s: requests per second each site may send on average
    :param burst: requests a site may send at once
    :param in_flight: requests handled at once (the issuer's workers); more wait in
        their site's queue
    :param site_queue: requests of one site that may wait; one more is dropped unread
        (counted per site): what one site's flood can hold up is its own queue
    """

    key: Path
    token_valid_s: float = DEFAULT_TOKEN_VALID_S
    jwt_valid_s: float = DEFAULT_JWT_VALID_S
    rate_per_s: float = 500.0
    burst: float = 1000.0
    in_flight: int = 64
    site_queue: int = 256


class _SiteRate:
    """A token bucket per site: ``burst`` requests at once, ``rate_per_s`` on average"""

    def __init__(self, rate_per_s: float, burst: float) -> None:
        self._rate = rate_per_s
        self._burst = burst
        self._sites: dict[str, tuple[float, float]] = {}

    def allow(self, site: str, now: float) -> bool:
        level, last = self._sites.pop(site, (self._burst, now))  # re-inserted: newest last
        if len(self._sites) >= MAX_SITES:  # the longest quiet is forgotten first
            del self._sites[next(iter(self._sites))]
        level = min(self._burst, level + (now - last) * self._rate)
        if level < 1.0:
            self._sites[site] = (level, now)
            return False
        self._sites[site] = (level - 1.0, now)
        return True


class Issuer:
    """
    Decides and answers bootstrap requests, signing with the authority's account key

    The manager's session holds two: one on its own connection that mints tokens, and
    the one its :class:`~broker.manager.issuer_thread.IssuerThread` answers with.

    :attr:`counts` holds ``minted``, ``issued_enroll``, ``issued_renew``,
    ``refused_<reason>``, ``dropped_reply_subject`` (a request whose reply subject is not
    its site's bootstrap inbox: answered nowhere), ``alarms`` (a token used again by
    another key: stolen, or a second job per drone) and, counted by the
    :class:`~broker.manager.issuer_thread.IssuerThread` that serves it,
    ``queue_full:<site>`` (requests of the site dropped unread: its queue was full).
    """

    def __init__(
        self,
        settings: IssuerSettings,
        key: IssuerKey,
        grants: GrantStore,
        registry: Registry,
        *,
        domain: str | None = None,
        counts: collections.Counter[str] | None = None,
        serve_site: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.grants = grants
        self.counts: collections.Counter[str] = collections.Counter() if counts is None else counts
        self._key = key
        self._registry = registry
        self._namespace: Namespace = registry.namespace
        self._domain = domain
        self._rate = _SiteRate(settings.rate_per_s, settings.burst)
        self._say = RateLimitedLog(log)
        self._serve_site = serve_site

    async def mint(self, site: str, drone: str) -> str:
        """
        A new one-time token for ``drone`` (:meth:`GrantStore.mint`); its site's requests
        are answered once this returns (``serve_site``)
        """
        now = dt.datetime.now(dt.UTC)
        token = await self.grants.mint(site, drone, self.settings.token_valid_s, now)
        self.counts["minted"] += 1
        if self._serve_site is not None:
            await self._serve_site(site)
        return token

    async def answer(self, nc: Client, site: str, reply: str, data: bytes) -> None:
        """
        Decide one request that came on ``site``'s bootstrap subject and answer it on ``nc``

        Never raises for what the request holds or for the grants bucket: a failure is
        answered ``unavailable`` (the drone asks again).
        """
        if not (is_token(site) and reply.startswith(bootstrap_inbox(site) + ".")):
            # the issuer may publish anywhere: a reply to a subject the requester chose
            # (another drone's event, a record's key) would write where the site may not
            self.counts["dropped_reply_subject"] += 1
            self._say.warning(
                f"reply {site}",
                "dropped a bootstrap request from site %r: its reply subject %r is not the"
                " site's bootstrap inbox",
                site[:200],
                reply[:200],
            )
            return
        try:
            answer = await self._decide(site, data)
        except Exception as err:  # the bucket or a bug: the drone asks again later
            log.warning("cannot answer a bootstrap request from site %s: %r", site, err)
            answer = self._refuse(site, "?", Refusal.UNAVAILABLE, "the issuer failed; ask again")
        try:
            # not msg.respond(): that would echo the request's headers
            await nc.publish(reply, encode(answer))
        except (nats.errors.Error, OSError) as err:
            log.debug("cannot send a bootstrap reply: %r", err)

    async def _decide(self, site: str, data: bytes) -> Issued | IssueRefused:
        if not self._rate.allow(site, time.monotonic()):
            return self._refuse(site, "?", Refusal.THROTTLED, "too many requests; ask again")
        try:
            request = decode_bootstrap_request(data)
        except SchemaError as err:
            return self._refuse(site, "?", Refusal.MALFORMED, str(err))
        drone = request.drone
        if request.site != site:
            return self._refuse(site, drone, Refusal.FORGED, "a request for another site")
        if not signature_valid(
            request.public_key, request_signing_input(request), request.signature
        ):
            return self._refuse(site, drone, Refusal.FORGED, "the signature does not match")
        self._clock(request)
        view = self._registry.view(site, drone)
        if view is not None and view.ended:
            return self._refuse(site, drone, Refusal.ENDED, f"the drone ended ({view.ended})")
        found = await self.grants.get(site, drone)
        if found is None:
            return self._refuse(site, drone, Refusal.UNKNOWN, "no token was minted for it")
        grant, revision = found
        if grant.revoked:
            return self._refuse(site, drone, Refusal.REVOKED, f"revoked: {grant.revoked}")
        if isinstance(request, EnrollRequest):
            return await self._enroll(request, grant, revision)
        if grant.public_key != request.public_key:
            return self._refuse(site, drone, Refusal.FORGED, "not the key it enrolled with")
        issued = self._sign(request)
        await self.grants.renewed(grant, revision, issued.expires)  # a lost race: no matter
        self.counts["issued_renew"] += 1
        log.debug("renewed the identity of %s/%s", site, drone)
        return issued

    async def _enroll(
        self, request: EnrollRequest, grant: Grant, revision: int
    ) -> Issued | IssueRefused:
        site, drone = request.site, request.drone
        if not tokens_match(request.token, grant.token_hash):
            return self._refuse(site, drone, Refusal.FORGED, "not the token minted for it")
        if grant.public_key is None:
            if dt.datetime.now(dt.UTC) > grant.token_expires:
                return self._refuse(site, drone, Refusal.EXPIRED, "the token expired unused")
            issued = self._sign(request)
            if not await self.grants.enroll(grant, revision, request.public_key, issued.expires):
                # another use of the token wrote first: decide again on what it wrote
                found = await self.grants.get(site, drone)
                if found is None or found[0].public_key != request.public_key:
                    return self._reused(request)
            self.counts["issued_enroll"] += 1
            log.info("drone %s/%s enrolled its key %s", site, drone, request.public_key[:12])
            return issued
        if grant.public_key != request.public_key:
            return self._reused(request)
        # the same key again (an agent restarted with its kept key): the same answer
        self.counts["issued_enroll"] += 1
        return self._sign(request)

    def _clock(self, request: AnyBootstrapRequest) -> None:
        """
        Count and warn about a request signed by a clock far off the issuer's

        Its time is not checked against the issuer's clock: worker clocks are wrong too
        often, and a request signed at any time gets only a JWT for the key that signed it.
        """
        offset = request.at.timestamp() - time.time()
        if abs(offset) <= self._registry.clock_skew_warn_s:
            return
        self.counts["clock_skewed"] += 1
        self._say.warning(
            f"clock {request.site}",
            "drone %s of site %s signed its request with a clock %.0fs %s the issuer's;"
            " answered all the same, but check the node's time service",
            request.drone,
            request.site,
            abs(offset),
            "ahead of" if offset > 0 else "behind",
            extra={"site": request.site, "drone": request.drone, "clock_offset_s": offset},
        )

    def _reused(self, request: EnrollRequest) -> IssueRefused:
        """The token was used by another key: stolen, or a second job with the drone's uuid"""
        self.counts["alarms"] += 1
        self._say.log(
            logging.ERROR,
            f"reused {request.site}",
            "ALARM: the bootstrap token of drone %s/%s was used already, by another key: it"
            " may have been stolen (from the batch system's view of the job) or the drone's"
            " uuid runs twice; if the drone asking now is the real one (its job runs), the"
            " identity went to someone else: cut it off with"
            " `cobald-remote auth revoke-bootstrapped %s`"
            ' (docs: operations, "Bootstrapped drones")',
            request.site,
            request.drone,
            request.drone,
            extra={"site": request.site, "drone": request.drone},
        )
        return self._refuse(request.site, request.drone, Refusal.REUSED, "the token was used")

    def _sign(self, request: AnyBootstrapRequest) -> Issued:
        valid_s = self.settings.jwt_valid_s
        jwt = drone_jwt(
            self._key,
            self._namespace,
            request.site,
            request.drone,
            request.public_key,
            valid_for_s=valid_s,
            domain=self._domain,
        )
        expires = dt.datetime.fromtimestamp(int(time.time()) + int(valid_s), dt.UTC)
        return Issued(jwt=jwt, expires=expires, valid_s=float(int(valid_s)))

    def _refuse(self, site: str, drone: str, reason: Refusal, error: str) -> IssueRefused:
        self.counts[f"refused_{reason}"] += 1
        self._say.warning(
            f"{reason} {site}",
            "refused a bootstrap request for drone %s from site %s's identity: %s (%s)",
            drone,
            site,
            reason,
            error,
            extra={"site": site, "drone": drone},
        )
        return IssueRefused(reason=reason, error=error)
