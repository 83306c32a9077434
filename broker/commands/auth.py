"""``cobald-remote auth init|drone|manager|leaf|revoke``: per-drone NATS credentials"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

from broker.commands.options import add_connection, add_json, add_prefix, add_seconds
from remote_agent.protocol.environment import site_of
from remote_agent.protocol.names import Namespace

if TYPE_CHECKING:
    from broker.server.auth.authority import AccountLimits


def _to_stdout(out: str | None) -> bool:
    return out is None or out == "-"


def _write_secret(text: str, out: str | None) -> None:
    from broker.errors import AuthError

    if out is None or out == "-":
        sys.stdout.write(text)
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # as for the authority file
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as err:
        raise AuthError(f"cannot write {out}: {err.strerror}") from err
    with os.fdopen(fd, "w") as stream:
        stream.write(text)


_UNITS: Final = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _size(text: str) -> int:
    """A byte count such as ``16G``, ``512MiB`` or ``-1`` (no limit)"""
    if text.strip() == "-1":
        return -1
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.I)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16G, 512M, -1)")
    return int(match[1]) * _UNITS[match[2].upper()]


def _account_limits(args: argparse.Namespace) -> AccountLimits:
    from broker.server.auth.authority import AccountLimits

    return AccountLimits(
        disk_bytes=args.max_disk,
        memory_bytes=args.max_memory,
        streams=args.max_streams,
        consumers=args.max_consumers,
        connections=args.max_connections,
        leaf_nodes=args.max_leaf_nodes,
    )


def _advise(args: argparse.Namespace, text: str) -> int:
    """Tell the operator what to do with what was written (on stderr: stdout may be a secret)"""
    if not args.json:
        print(text, file=sys.stderr)
    return 0


def _result(
    args: argparse.Namespace, facts: dict[str, object], key: str, text: str, out: str | None
) -> None:
    """
    Write the secret ``text`` to ``out``, or print it; with ``--json`` print ``facts``
    instead, with the secret under ``key`` unless a file holds it
    """
    from broker.commands.table import write_json

    printed = _to_stdout(out)
    if not (args.json and printed):
        _write_secret(text, out)
    if args.json:
        write_json({**facts, key: text if printed else None, "out": None if printed else out})


def _auth_init(args: argparse.Namespace) -> int:
    from broker.server.auth.authority import create_authority, save_authority
    from broker.server.auth.jwt import key_of, public_of

    authority = create_authority(args.name, _account_limits(args))
    save_authority(authority, Path(args.authority))
    facts: dict[str, object] = {
        "authority": args.authority,
        "operator": public_of(key_of(authority.operator)),
        "account": authority.account_public,
    }
    _result(args, facts, "server_config", authority.server_config(), args.server_config)
    where = "printed above" if _to_stdout(args.server_config) else f"in {args.server_config}"
    return _advise(
        args,
        f"authority written to {args.authority} (keep it secret); include the server "
        f"configuration {where} from the nats-server configuration and restart it "
        '(docs: deployment, "Per-drone credentials")',
    )


def _auth_drone(args: argparse.Namespace) -> int:
    from broker.errors import AuthError
    from broker.server.auth.authority import load_authority
    from broker.server.auth.credentials import DroneLimits, drone_credentials

    site = args.site or site_of(args.drone)
    if not site:
        raise AuthError(f"cannot tell the site of drone {args.drone!r}: give --site")
    text = drone_credentials(
        load_authority(Path(args.authority)),
        Namespace(args.prefix),
        site,
        args.drone,
        domain=args.domain,
        valid_for_s=args.valid_for if args.valid_for > 0 else None,
        limits=DroneLimits(args.max_subscriptions, args.max_payload),
    )
    _issue(args, text)
    return 0


def _issue(args: argparse.Namespace, creds: str, **facts: object) -> None:
    """Write the credentials where asked, and note the user as issued"""
    from broker.server.auth.jwt import creds_claims
    from broker.server.auth.revocation import note_issued

    note_issued(Path(args.authority), creds)
    claims = creds_claims(creds)
    about = {
        "name": claims.get("name"),
        "user": claims.get("sub"),
        "issued_at": claims.get("iat"),
        "expires_at": claims.get("exp"),
    }
    _result(args, {**about, **facts}, "creds", creds, args.out)


def _auth_manager(args: argparse.Namespace) -> int:
    from broker.server.auth.authority import load_authority
    from broker.server.auth.credentials import manager_credentials

    _issue(args, manager_credentials(load_authority(Path(args.authority)), args.name))
    return 0


def _auth_leaf(args: argparse.Namespace) -> int:
    from broker.server.auth.authority import load_authority
    from broker.server.auth.credentials import leaf_credentials

    authority = load_authority(Path(args.authority))
    _issue(args, leaf_credentials(authority, args.site), account=authority.account_public)
    where = "<this file>" if _to_stdout(args.out) else args.out
    return _advise(
        args,
        f"in leaf.conf's remote: credentials: {where} and account: {authority.account_public}; "
        'and include "auth.conf" (docs: deployment, "A leaf node per site")',
    )


def _auth_bootstrap(args: argparse.Namespace) -> int:
    from broker.server.auth.authority import load_authority
    from broker.server.auth.credentials import bootstrap_credentials

    authority = load_authority(Path(args.authority))
    valid_for_s = args.valid_for if args.valid_for > 0 else None
    _issue(
        args,
        bootstrap_credentials(
            authority, Namespace(args.prefix), args.site, valid_for_s, args.source
        ),
    )
    return _advise(
        args,
        f"install it where the drones of site {args.site} find it (bus.bootstrap_creds, or "
        "$COBALD_REMOTE_BOOTSTRAP_CREDS); it lets them ask the issuer, nothing else "
        '(docs: deployment, "Bootstrapped identities")',
    )


def _auth_issuer_key(args: argparse.Namespace) -> int:
    from broker.server.auth.authority import issuer_key_of, load_authority, save_issuer_key

    key = issuer_key_of(load_authority(Path(args.authority)))
    save_issuer_key(key, Path(args.out))
    if args.json:  # what was written where; the secret stays in the file
        from broker.commands.table import write_json

        write_json({"out": args.out, "account": key.account_public})
    return _advise(
        args,
        f"issuer key written to {args.out}: give the manager that file (bus.bootstrap_key), "
        "not the authority; it lets its reader make users of the account, so keep it secret",
    )


async def _revoke_grants(args: argparse.Namespace) -> int:
    from broker.commands.options import connected
    from broker.errors import AuthError
    from broker.manager.grants import GrantStore

    revoked = []
    async with connected(args, "cobald-remote-auth") as nc:
        grants = await GrantStore.open(nc.jetstream(domain=args.domain), Namespace(args.prefix))
        for drone in args.drones:
            site = args.site or site_of(drone)
            if not site:
                raise AuthError(f"cannot tell the site of drone {drone!r}: give --site")
            if await grants.revoke(site, drone, args.reason) is None:
                raise AuthError(f"drone {site}/{drone} has no bootstrap grant")
            revoked.append(f"{site}/{drone}")
    if args.json:
        from broker.commands.table import write_json

        write_json({"revoked": revoked})
    return _advise(
        args,
        f"revoked {', '.join(revoked)}: the issuer renews no JWT for them; they are cut off "
        "on every server and leaf node when their current JWT expires "
        "(bus.bootstrap_jwt_valid_s)",
    )


def _auth_revoke_grants(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_revoke_grants(args))


def _auth_revoke(args: argparse.Namespace) -> int:
    from broker.errors import AuthError
    from broker.server.auth.authority import load_authority, update_authority
    from broker.server.auth.revocation import expired_users, issued_log, issued_users, revoke

    path = Path(args.authority)
    users = list(args.user or [])
    for name in args.names:
        found = issued_users(path, name)
        if not found:
            raise AuthError(
                f"no credentials issued as {name!r} in {issued_log(path)}; give --user KEY"
            )
        users += found
    if not users:
        raise AuthError("name a drone (or user) to revoke, or give --user KEY")
    authority = revoke(load_authority(path), users, expired=expired_users(path))
    update_authority(authority, path)
    facts: dict[str, object] = {"revoked": users}
    _result(args, facts, "server_config", authority.server_config(), args.server_config)
    return _advise(
        args,
        f"revoked {len(users)} credentials; reload every server and leaf node that includes "
        "this configuration (systemctl reload cobald-remote-nats...; docs: deployment, "
        '"Revoking credentials")',
    )


def add_commands(auth: argparse.ArgumentParser) -> None:
    """Add the ``auth`` group's commands"""
    from broker.server.auth.authority import AccountLimits
    from broker.server.auth.credentials import DEFAULT_DRONE_VALIDITY_S, DroneLimits

    commands = auth.add_subparsers(dest="command", required=True, metavar="COMMAND")
    init = commands.add_parser(
        "init", help="make the operator and account keys, print the server configuration"
    )
    init.add_argument("--authority", required=True, help="file for the seeds (made 0600, once)")
    init.add_argument("--server-config", help="write the server configuration here (0600)")
    init.add_argument("--name", default="cobald-remote", help="operator and account name")
    account = AccountLimits()
    for flag, dest, kind, default, what in (
        ("--max-disk", "max_disk", _size, account.disk_bytes, "JetStream file storage"),
        ("--max-memory", "max_memory", _size, account.memory_bytes, "JetStream memory"),
        ("--max-streams", "max_streams", int, account.streams, "streams"),
        ("--max-consumers", "max_consumers", int, account.consumers, "consumers per stream"),
        ("--max-connections", "max_connections", int, account.connections, "connections"),
        ("--max-leaf-nodes", "max_leaf_nodes", int, account.leaf_nodes, "leaf node connections"),
    ):
        init.add_argument(
            flag,
            dest=dest,
            type=kind,
            default=default,
            metavar="N",
            help=f"the account's {what} (default {default}; -1: no limit)",
        )
    add_json(init)
    init.set_defaults(run=_auth_init)
    drone = commands.add_parser("drone", help="a .creds file for one drone, on stdout")
    drone.add_argument("drone", help="the drone's uuid")
    drone.add_argument("--site", help="default: the uuid before its last '-'")
    drone.add_argument("--authority", required=True, help="the file auth init wrote")
    add_prefix(drone)
    drone.add_argument("--domain", help="JetStream domain the drone names (behind a leaf node)")
    add_seconds(
        drone,
        "--valid-for",
        DEFAULT_DRONE_VALIDITY_S,
        f"seconds until it expires (default {DEFAULT_DRONE_VALIDITY_S}; 0: never)",
        metavar="S",
    )
    limits = DroneLimits()
    drone.add_argument(
        "--max-subscriptions",
        type=int,
        default=limits.subscriptions,
        metavar="N",
        help=f"subscriptions at once (default {limits.subscriptions}; -1: no limit)",
    )
    drone.add_argument(
        "--max-payload",
        type=_size,
        default=limits.payload_bytes,
        metavar="BYTES",
        help=f"largest message with its headers (default {limits.payload_bytes})",
    )
    drone.add_argument("--out", help="write here (0600) instead of stdout")
    add_json(drone)
    drone.set_defaults(run=_auth_drone)
    manager = commands.add_parser("manager", help="a .creds file for the manager, on stdout")
    manager.add_argument("--authority", required=True, help="the file auth init wrote")
    manager.add_argument("--name", default="manager", help="user name")
    manager.add_argument("--out", help="write here (0600) instead of stdout")
    add_json(manager)
    manager.set_defaults(run=_auth_manager)
    leaf = commands.add_parser("leaf", help="a .creds file for a site's leaf node, on stdout")
    leaf.add_argument("site", help="the site's name (as in drone uuids)")
    leaf.add_argument("--authority", required=True, help="the file auth init wrote")
    leaf.add_argument("--out", help="write here (0600) instead of stdout")
    add_json(leaf)
    leaf.set_defaults(run=_auth_leaf)
    bootstrap = commands.add_parser(
        "bootstrap", help="a .creds file of a site's bootstrap identity (drones ask the issuer)"
    )
    bootstrap.add_argument("site", help="the site's name (as in drone uuids)")
    bootstrap.add_argument("--authority", required=True, help="the file auth init wrote")
    add_prefix(bootstrap)
    add_seconds(
        bootstrap, "--valid-for", 0, "seconds until it expires (default 0: never)", metavar="S"
    )
    bootstrap.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="CIDR",
        help="connect only from this network, e.g. the site's worker nodes' (repeat for more; "
        "default: from anywhere)",
    )
    bootstrap.add_argument("--out", help="write here (0600) instead of stdout")
    add_json(bootstrap)
    bootstrap.set_defaults(run=_auth_bootstrap)
    issuer_key = commands.add_parser(
        "issuer-key", help="the account signing key alone, for the manager's issuer (0600)"
    )
    issuer_key.add_argument("--authority", required=True, help="the file auth init wrote")
    issuer_key.add_argument("--out", required=True, help="write it here (made 0600)")
    add_json(issuer_key)
    issuer_key.set_defaults(run=_auth_issuer_key)
    grants = commands.add_parser(
        "revoke-bootstrapped",
        help="renew no identity of bootstrapped drones: cut off once their JWT expires",
    )
    grants.add_argument("drones", nargs="+", metavar="DRONE", help="drone uuid")
    grants.add_argument("--site", help="default: each uuid before its last '-'")
    grants.add_argument("--reason", default="revoked by an operator", help="noted in the grant")
    add_connection(grants)
    add_json(grants)
    grants.set_defaults(run=_auth_revoke_grants)
    revoke_ = commands.add_parser(
        "revoke", help="refuse credentials before they expire; prints the new server configuration"
    )
    revoke_.add_argument(
        "names", nargs="*", metavar="NAME", help="drone uuid (or user name) as issued"
    )
    revoke_.add_argument("--user", action="append", help="a user public key (U...), repeatable")
    revoke_.add_argument("--authority", required=True, help="the file auth init wrote")
    revoke_.add_argument("--server-config", help="write the server configuration here (0600)")
    add_json(revoke_)
    revoke_.set_defaults(run=_auth_revoke)
