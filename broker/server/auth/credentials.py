"""
The users each identity gets (drone, manager, site leaf node) and their ``.creds`` files

A drone's user may publish only its own events and write only its own handshake
record (``docs/agent.md``), so the server refuses a drone speaking for another.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import nkeys

from broker.errors import AuthError
from broker.server.auth.authority import Authority, IssuerKey
from broker.server.auth.jwt import creds_file, encode_jwt, key_of, new_key, public_of, seed_of
from remote_agent.protocol.bootstrap import MAX_BOOTSTRAP_MESSAGE
from remote_agent.protocol.events import EVENT_TYPES, kind_of
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import (
    Namespace,
    bootstrap_inbox,
    check_token,
    direct_get,
    inbox_prefix,
    kv_write_prefix,
)

#: how long a drone's credentials are valid by default (a drone lives hours to days)
DEFAULT_DRONE_VALIDITY_S: Final = 7 * 24 * 3600
#: the connection type of a client connection (nats-io/jwt ``ConnectionTypeStandard``)
_STANDARD: Final = "STANDARD"


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


def user_jwt(
    authority: Authority | IssuerKey,
    public_key: str,
    name: str,
    permissions: Mapping[str, Any],
    valid_for_s: float | None,
    limits: Mapping[str, Any] | None = None,
) -> str:
    """A user JWT of the account for ``public_key``, signed by the account's signing key"""
    now = int(time.time())
    claims: dict[str, Any] = {
        "iat": now,
        "sub": public_key,
        "name": name,
        "nats": {
            "type": "user",
            "version": 2,
            "subs": -1,
            "data": -1,
            "payload": -1,
            **(limits or {}),
            "issuer_account": authority.account_public,
            **permissions,
        },
    }
    if valid_for_s is not None:
        claims["exp"] = now + int(valid_for_s)
    return encode_jwt(claims, key_of(authority.account_signing))


def _user(
    authority: Authority,
    name: str,
    permissions: Mapping[str, Any],
    valid_for_s: float | None,
    limits: Mapping[str, Any] | None = None,
) -> str:
    """A ``.creds`` file (text) of a new user of the account, signed by its signing key"""
    user = new_key(nkeys.PREFIX_BYTE_USER)
    jwt = user_jwt(authority, public_of(user), name, permissions, valid_for_s, limits)
    return creds_file(jwt, seed_of(user))


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


def drone_jwt(
    authority: Authority | IssuerKey,
    namespace: Namespace,
    site: str,
    drone: str,
    public_key: str,
    *,
    valid_for_s: float,
    domain: str | None = None,
    limits: DroneLimits | None = None,
) -> str:
    """
    A user JWT for one drone's own key (``public_key``), with exactly the permissions of
    :func:`drone_credentials`: what the issuer signs for a bootstrapped drone
    """
    permissions = drone_permissions(namespace, site, drone, domain)
    limits = limits or DroneLimits()
    return user_jwt(
        authority, public_key, f"drone-{drone}", permissions, valid_for_s, limits.claims()
    )


def bootstrap_permissions(namespace: Namespace, site: str) -> dict[str, Any]:
    """
    What a site's bootstrap identity may do: send requests to the issuer, read the replies

    Nothing else: no event, record, bucket or JetStream API subject.
    """
    return {
        "pub": {"allow": [namespace.bootstrap(site)]},
        "sub": {"allow": [f"{bootstrap_inbox(site)}.>"]},
    }


def bootstrap_limits(sources: Sequence[str] = ()) -> dict[str, Any]:
    """
    What nats-server enforces for a site's bootstrap identity (``docs/deployment.md#limits``)

    A request is at most what the issuer decodes (a larger one closes the connection
    before it reaches the issuer); four subscriptions (an agent holds one, its request
    inbox); standard connections only; with ``sources``, connections from those networks
    only (the user JWT's ``src``).

    :param sources: networks in CIDR notation (``192.0.2.0/24``, ``2001:db8::/32``)
    :raises AuthError: if a source is not a network
    """
    limits = DroneLimits(subscriptions=4, payload_bytes=MAX_BOOTSTRAP_MESSAGE).claims()
    if sources:
        networks = []
        for source in sources:
            try:
                networks.append(str(ipaddress.ip_network(source, strict=False)))
            except ValueError:
                raise AuthError(
                    f"{source!r} is not a network in CIDR notation (e.g. 192.0.2.0/24)"
                ) from None
        limits["src"] = networks
    return limits


def bootstrap_credentials(
    authority: Authority,
    namespace: Namespace,
    site: str,
    valid_for_s: float | None = None,
    sources: Sequence[str] = (),
) -> str:
    """
    A ``.creds`` file (text) of a site's bootstrap identity, shared by its drones

    :raises AuthError: if a source is not a network (:func:`bootstrap_limits`)
    """
    return _user(
        authority,
        f"bootstrap-{site}",
        bootstrap_permissions(namespace, site),
        valid_for_s,
        bootstrap_limits(sources),
    )


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
    return _user(authority, f"drone-{drone}", permissions, valid_for_s, limits.claims())


def manager_credentials(authority: Authority, name: str = "manager") -> str:
    """A ``.creds`` file (text) for the manager, operators and ``broker init``: no limits"""
    return _user(authority, name, {}, None)


def leaf_credentials(authority: Authority, site: str) -> str:
    """
    A ``.creds`` file (text) for a site's leaf node connecting to the hub

    The leaf node checks its drones' own credentials itself (it includes the
    same server configuration); its connection to the hub carries all of
    them, so the user has no limits in the account, like the manager's. The
    leaf's remote also names the account (:attr:`Authority.account_public`).
    """
    check_token(site, "site")
    return _user(authority, f"leaf-{site}", {}, None)
