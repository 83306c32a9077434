"""
``cobald-remote selftest``: one stand-in drone's whole life against the site's server and manager

Parsing and printing only; the self-test itself is :mod:`broker.manager.selftest`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from broker.commands.failures import EXIT_FAILURE
from broker.commands.options import add_connection, add_json, add_seconds
from broker.commands.table import write_json
from broker.commands.timeline import format_timeline

if TYPE_CHECKING:
    from broker.manager.selftest import Result

#: how a step's outcome reads
_MARK = {True: "passed", False: "FAILED", None: "not run"}


def _text(result: Result) -> str:
    width = max(len(step.name) for step in result.steps)
    lines = [f"self-test of drone {result.site}/{result.drone} ({result.mode}):"]
    for step in result.steps:
        lines.append(f"  {_MARK[step.ok]:<7}  {step.name:<{width}}  {step.detail}".rstrip())
        if step.fix:
            lines.append(f"  {'':<7}  {'':<{width}}  fix: {step.fix}")
    if result.timeline:
        lines += ["", format_timeline(result.timeline)]
    lines.append("")
    lines.append("left behind: " + ("; ".join(result.remains) or "nothing"))
    lines.append("PASSED" if result.passed else "FAILED")
    return "\n".join(lines)


async def selftest(args: argparse.Namespace) -> int:
    """``cobald-remote selftest``: exit 0 if every step passed, 1 otherwise"""
    from broker.manager.selftest import Options, run_selftest

    result = await run_selftest(
        Options(
            server=args.server,
            creds=args.creds,
            prefix=args.prefix,
            domain=args.domain,
            site=args.site,
            drone_creds=args.drone_creds,
            bootstrap_creds=args.bootstrap_creds,
            timeout_s=args.timeout,
        )
    )
    if args.json:
        write_json(result.to_json())
    else:
        print(_text(result))
    return 0 if result.passed else EXIT_FAILURE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``selftest``'s arguments"""
    from broker.manager.selftest import SELFTEST_PREFIX

    parser.description = (
        "Run one stand-in drone's whole life against the server and the running manager: "
        "the real agent around a stand-in worker gets its identity (bootstrap or per-drone "
        "credentials), claims its handshake record, publishes events the manager reads, is "
        "drained, ends, and its timeline is read. Each step prints passed or failed with what "
        f"to fix; exit 1 if one failed. The drone is named {SELFTEST_PREFIX}<10 hex>; its "
        "record, grant and events are purged at the end."
    )
    add_connection(parser, creds_help="NATS credentials file of the manager")
    parser.add_argument("--site", help="the stand-in drone's site (default: its --drone-creds')")
    identity = parser.add_mutually_exclusive_group()
    identity.add_argument(
        "--bootstrap-creds",
        metavar="FILE",
        help="the site's bootstrap credentials (auth bootstrap SITE): enroll with the issuer",
    )
    identity.add_argument(
        "--drone-creds",
        metavar="FILE",
        help=f"a drone's credentials (auth drone {SELFTEST_PREFIX}0123456789 --site SITE)",
    )
    add_seconds(parser, "--timeout", 60.0, "seconds each step waits (default 60)")
    add_json(parser)
    parser.set_defaults(run=selftest)
