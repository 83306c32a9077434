"""
Operator commands: ``cobald-remote drain``, ``release`` and ``status``

They use the same control API as the TARDIS integration (:mod:`broker.manager.control`)
and the same registry rebuild as the manager service (:func:`broker.manager.rebuild.rebuild`),
so what an operator sees and does is what the manager sees and does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker.commands.failures import EXIT_FAILURE
from broker.commands.intent import permission_errors, refuse_unknown
from broker.commands.options import (
    add_connection,
    add_json,
    add_seconds,
    connected,
    refused,
)
from broker.commands.table import format_table, write_json
from broker.errors import OperatorError
from remote_agent.protocol.environment import site_of
from remote_agent.protocol.names import Namespace, check_token

if TYPE_CHECKING:
    from nats.aio.client import Client

    from broker.manager.control import Control
    from broker.manager.outcomes import DrainResult
    from broker.manager.views import DroneView

#: exit status when the intent is recorded but the agent did not confirm it
EXIT_UNCONFIRMED = 3


def _site(drone: str) -> str:
    """The site of a TARDIS drone uuid"""
    site = site_of(drone)
    if site is None:
        raise OperatorError(
            f"cannot tell the site of drone {drone!r} (TARDIS uuids are <site>-<10 hex>): "
            "give --site"
        )
    return site


def _target(args: argparse.Namespace) -> tuple[str, str]:
    drone = check_token(args.drone, "drone uuid")
    return check_token(args.site or _site(drone), "site"), drone


#: the name of the commands' client connections
_CLIENT = "cobald-remote-ops"


async def _control(nc: Client, args: argparse.Namespace) -> Control:
    import nats.errors

    from broker.manager.control import Control
    from broker.manager.registry import Registry

    registry = Registry(Namespace(args.prefix))
    try:
        return await Control.open(nc, registry, domain=args.domain, request_timeout_s=args.timeout)
    except nats.errors.Error as err:
        raise OperatorError(refused(nc) or f"cannot open the handshake buckets: {err}") from None


def _print_json(value: object) -> None:
    import msgspec

    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def _drain_line(site: str, drone: str, result: DrainResult) -> str:
    text = f"{site}/{drone}: drain {result.outcome}"
    if result.intent is not None:
        text += f", deadline {result.intent.deadline.isoformat(timespec='seconds')}"
    if result.detail:
        text += f": {result.detail}"
    return text


def _drain_status(result: DrainResult) -> int:
    from broker.manager.outcomes import DrainOutcome

    if result.outcome is DrainOutcome.NOT_ANNOUNCED:
        return EXIT_FAILURE
    if result.outcome in (DrainOutcome.UNANSWERED, DrainOutcome.REFUSED):
        return EXIT_UNCONFIRMED
    return 0


async def drain(args: argparse.Namespace) -> int:
    """``cobald-remote drain DRONE``: record the drain intent, then tell the agent"""
    site, drone = _target(args)
    if args.deadline < 0:
        raise OperatorError("--deadline must not be negative")
    async with connected(args, _CLIENT) as nc:
        with permission_errors(nc):
            control = await _control(nc, args)
            await refuse_unknown(
                nc, control, site, drone, domain=args.domain, force=args.force, command="drain"
            )
            deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=args.deadline)
            result = await control.drain(site, drone, deadline, args.reason)
    if args.json:
        _print_json({"site": site, "drone": drone, "result": result})
    else:
        print(_drain_line(site, drone, result))
    return _drain_status(result)


async def release(args: argparse.Namespace) -> int:
    """``cobald-remote release DRONE``: win the race with the agent, or drain it"""
    from broker.manager.outcomes import ReleaseOutcome

    site, drone = _target(args)
    async with connected(args, _CLIENT) as nc:
        with permission_errors(nc):
            control = await _control(nc, args)
            await refuse_unknown(
                nc, control, site, drone, domain=args.domain, force=args.force, command="release"
            )
            result = await control.release(
                site, drone, note=args.reason or "operator release", reason=args.reason
            )
    if args.json:
        _print_json({"site": site, "drone": drone, "result": result})
    elif result.outcome is ReleaseOutcome.RELEASED:
        print(f"{site}/{drone}: released: {result.detail}; its batch job may be removed")
    else:
        assert result.drain is not None
        print(f"{site}/{drone}: the agent had come up; " + _drain_line(site, drone, result.drain))
    if result.drain is not None:
        return _drain_status(result.drain)
    return 0


# ---------------------------------------------------------------------- status


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _row(
    view: DroneView,
    now: float,
    lost_after_s: float,
    skew_warn_s: float,
    noisy_at: float | None,
    black_hole: str | None,
) -> dict[str, Any]:
    import msgspec

    record = view.record
    snapshot = view.snapshot  # decoded on every access: once
    return {
        "site": view.site,
        "drone": view.drone,
        "state": str(view.state) if view.state is not None else None,
        "gate_open": snapshot.gate_open if snapshot is not None else None,
        "payloads": [msgspec.to_builtins(p) for p in snapshot.payloads] if snapshot else [],
        "last_event": view.kind or None,
        "seq": view.seq,
        "last_fact_age_s": view.last_fact_age_s(now),
        "last_event_received": _iso(view.received_time),
        "last_heartbeat_received": _iso(view.heartbeat_time),
        "clock_offset_s": view.clock_offset_s,
        "clock_skewed": view.clock_skewed(skew_warn_s),
        "lost": view.counts_lost(now, lost_after_s),
        "noisy": noisy_at is not None,
        "noisy_at": _iso(noisy_at),
        "noisy_age_s": now - noisy_at if noisy_at is not None else None,
        "ended": view.ended or None,
        "ended_at": _iso(view.ended_time),
        "black_hole": black_hole,
        "record_phase": record.label if record is not None else None,
        "record_writer": record.writer if record is not None else None,
        "record_proven": record.proven if record is not None else None,
        "record_tampered": record.tampered if record is not None else None,
        "record_revision": record.revision if record is not None else None,
        "drain_deadline": record.drain.deadline.isoformat()
        if record is not None and record.drain is not None
        else None,
        "drain_due": _iso(record.drain_due) if record is not None else None,
    }


def _fate(row: dict[str, Any]) -> str:
    """The LOST/ENDED column: lost, or why it ended, and whether it is a black hole"""
    text = "lost" if row["lost"] else (f"ended: {row['ended']}" if row["ended"] else "-")
    return f"{text}, black hole" if row["black_hole"] else text


def _clock(offset_s: float) -> str:
    """A clock offset as the table shows it: ``+25h`` ahead, ``-10d`` behind"""
    return ("+" if offset_s >= 0 else "-") + _age(abs(offset_s))


def _iso(epoch: float | None) -> str | None:
    from broker.manager.views import iso_time

    return None if epoch is None else iso_time(epoch)


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        "DRONE",
        "SITE",
        "STATE",
        "PAYLOADS",
        "LAST FACT",
        "NOISY",
        "LOST/ENDED",
        "RECORD",
        "CLOCK",
    )
    return format_table(
        header,
        (
            (
                row["drone"],
                row["site"],
                row["state"] or "-",
                str(len(row["payloads"])),
                _age(row["last_fact_age_s"]),
                _age(row["noisy_age_s"]),
                _fate(row),
                row["record_phase"] or "-",
                _clock(row["clock_offset_s"]) if row["clock_skewed"] else "-",
            )
            for row in rows
        ),
    )


async def status(args: argparse.Namespace) -> int:
    """``cobald-remote status [DRONE]``: every drone's state, as the manager rebuilds it"""
    import contextlib

    from broker.jetstream.reads import stream_errors
    from broker.manager.blackholes import BlackHoles
    from broker.manager.rebuild import rebuild
    from broker.manager.registry import Registry
    from remote_agent.protocol.errors import HandshakeError
    from remote_agent.protocol.names import api_prefix
    from remote_agent.protocol.proof import load_proof_key

    if args.since is not None and args.since < 0:
        raise OperatorError("--since must not be negative")
    namespace = Namespace(args.prefix)
    registry = Registry(
        namespace,
        lost_after_s=args.lost_after,
        retain_lost_s=0,  # it retires nothing
        clock_skew_warn_s=args.clock_skew_warn,
        warn_clocks=False,  # the CLOCK column says it
    )
    black_holes = BlackHoles(tell=False)  # the summary line says it
    registry.watchers.append(black_holes.seen)
    async with connected(args, _CLIENT) as nc:
        with stream_errors(OperatorError, "stream or bucket"):
            js = nc.jetstream(domain=args.domain)
            with contextlib.suppress(HandshakeError):  # without it, no release reads as proven
                registry.proof_key = await load_proof_key(js, namespace)
            await rebuild(nc, js, registry, api=api_prefix(args.domain), window_s=args.since)
    now = time.time()
    views = sorted(registry.views().values(), key=lambda v: (v.site, v.drone))
    if args.site:
        views = [v for v in views if v.site == args.site]
    if args.drone:
        views = [v for v in views if v.drone == args.drone]
        if not views:
            raise OperatorError(f"no drone {args.drone!r} known on {args.server}")
    ended = sum(bool(v.ended) for v in views)
    if not (args.ended or args.drone):
        views = [v for v in views if not v.ended]
    noisy = registry.noisy(now)
    rows = [
        _row(
            view,
            now,
            args.lost_after,
            args.clock_skew_warn,
            noisy.get(view.key),
            black_holes.verdict(view.site, view.drone),
        )
        for view in views
    ]
    if args.json:
        write_json(rows)
    elif rows:
        print(_table(rows))
    elif not ended:
        print("no drones known", file=sys.stderr)
    if not args.json:
        lost = sum(row["lost"] for row in rows)
        loud = sum(row["noisy"] for row in rows)
        hidden = "" if args.ended or args.drone or not ended else " (hidden; --ended shows them)"
        known = len(rows) + (0 if args.ended or args.drone else ended)
        print(
            f"{known} drone{'' if known == 1 else 's'}: "
            f"{lost} lost, {loud} noisy, {ended} ended{hidden}",
            file=sys.stderr,
        )
        for site, flag in sorted(black_holes.flags.items()):
            if args.site in (None, site):
                print(
                    f"site {site} is a black hole: {flag.drones} drones in a row "
                    f"{black_holes.rules.meaning(flag.verdict, 'their')} (the last "
                    f"{flag.last}), of the drones this rebuild reads",
                    file=sys.stderr,
                )
    return 0


# ---------------------------------------------------------------------- wiring


def _add_target(parser: argparse.ArgumentParser) -> None:
    """The drone to act on (:func:`_target`)"""
    parser.add_argument("drone", help="drone uuid, e.g. site1-0123456789")
    parser.add_argument("--site", help="site (default: the uuid before its last '-')")


def _add_timeout(parser: argparse.ArgumentParser, help_text: str) -> None:
    from broker.manager.control import DEFAULT_REQUEST_TIMEOUT_S

    add_seconds(parser, "--timeout", DEFAULT_REQUEST_TIMEOUT_S, help_text)


def _common(parser: argparse.ArgumentParser) -> None:
    add_connection(parser, creds_help="NATS credentials file of the manager")
    add_json(parser)


def add_drain(drain_cmd: argparse.ArgumentParser) -> None:
    """Add ``drain``'s arguments"""
    from broker.manager.control import DEFAULT_DRAIN_S

    drain_cmd.description = (
        "Record a drain intent in the drone's handshake record and ask its agent "
        f"to drain. Exit 0 when the drain is in effect, 1 on errors, {EXIT_UNCONFIRMED} when "
        "the intent is recorded but the agent did not confirm it (it acts on it when it "
        "reconnects)."
    )
    _add_target(drain_cmd)
    add_seconds(
        drain_cmd,
        "--deadline",
        DEFAULT_DRAIN_S,
        f"seconds from now until the drain deadline (default {DEFAULT_DRAIN_S:.0f})",
    )
    _add_intent(drain_cmd, drain, "operator drain", "wait this long for the agent's answer")


def _add_intent(
    parser: argparse.ArgumentParser, run: Callable[..., Any], reason: str, timeout_help: str
) -> None:
    """The rest of a command that records an intent, then waits for the agent"""
    parser.add_argument("--reason", default=reason, help="why (kept in the record)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="act on a drone with no event and no record (e.g. one whose agent never started)",
    )
    _add_timeout(parser, timeout_help)
    _common(parser)
    parser.set_defaults(run=run)


def add_release(release_cmd: argparse.ArgumentParser) -> None:
    """Add ``release``'s arguments"""
    release_cmd.description = (
        "Release the drone through its handshake record. If the manager wins, "
        "no payload can ever start and the batch job may be removed; if the agent came up "
        "first, the drone is drained instead (exit codes as for drain)."
    )
    _add_target(release_cmd)
    _add_intent(
        release_cmd, release, "", "wait this long for the agent's answer if it has to be drained"
    )


def add_status(status_cmd: argparse.ArgumentParser) -> None:
    """Add ``status``'s arguments"""
    from broker.manager.registry import DEFAULT_LOST_AFTER_S
    from broker.manager.views import DEFAULT_CLOCK_SKEW_WARN_S

    status_cmd.description = (
        "Rebuild the registry from the event stream and the handshake bucket "
        "(read-only, no durable consumer) and print every drone, or one."
    )
    status_cmd.add_argument("drone", nargs="?", help="only this drone")
    status_cmd.add_argument("--site", help="only this site")
    status_cmd.add_argument(
        "--ended",
        "--all",
        action="store_true",
        help="show drones whose life ended, too (until they retire)",
    )
    add_seconds(
        status_cmd,
        "--lost-after",
        DEFAULT_LOST_AFTER_S,
        f"no sign of life for this long = lost (default {DEFAULT_LOST_AFTER_S:.0f})",
    )
    status_cmd.add_argument(
        "--since",
        type=float,
        metavar="SECONDS",
        help="read every event of the last SECONDS (default twice --lost-after): a drone "
        "without a handshake record (it never claimed one) shows only if it spoke in them",
    )
    add_seconds(
        status_cmd,
        "--clock-skew-warn",
        DEFAULT_CLOCK_SKEW_WARN_S,
        "a drone clock off the server's by more is shown in CLOCK "
        f"(default {DEFAULT_CLOCK_SKEW_WARN_S:.0f})",
    )
    _common(status_cmd)
    status_cmd.set_defaults(run=status)
