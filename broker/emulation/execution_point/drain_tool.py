"""The fake ``condor_drain``, as ``src/condor_tools/drain.cpp`` parses and answers"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.emulation.execution_point.config import Config
from broker.emulation.execution_point.tool_support import (
    ask_master,
    is_dash_arg_prefix,
    load_config,
    print_err,
    print_out,
)

_COMPLETIONS = {
    1: "-resume-on-completion",
    2: "-exit-on-completion",
    3: "-restart-on-completion",
    4: "-reconfig-on-completion",
}
_COMPLETION_NAMES = {0: "nothing", 1: "resume", 2: "exit", 3: "restart", 4: "reconfig"}


def _drain_usage(name: str) -> int:
    print_err(
        f"Usage: {name} [OPTIONS] machine\n\nOPTIONS:\n"
        "-cancel           Stop draining.\n"
        "-debug            Display debugging info to console\n"
        "-graceful         (the default) Honor MaxVacateTime and MaxJobRetirementTime.\n"
        "-quick            Honor MaxVacateTime but not MaxJobRetirementTime.\n"
        "-fast             Honor neither MaxVacateTime nor MaxJobRetirementTime.\n"
        "-reason <text>    While draining, advertise <text> as the reason.\n"
        "-resume-on-completion    When done draining, resume normal operation.\n"
        "-exit-on-completion      When done draining, STARTD should exit and not restart.\n"
        "-restart-on-completion   When done draining, STARTD should restart.\n"
        "-reconfig-on-completion  When done draining, STARTD should reconfig and resume.\n"
        "-request-id <id>  Specific request id to cancel (optional).\n"
        "-check <expr>     Must be true for all slots to be drained or request is aborted.\n"
        "-start <expr>     Change START expression to this while draining.\n"
    )
    return 1


def _another(name: str, arg: str) -> int:
    print_err(f"{name}: '{arg}' requires another argument\n")
    return _drain_usage(name)


def _conflict(name: str, arg: str, previous: int) -> int:
    print_err(
        f"{name}: '{arg}' conflicts with previous use of "
        f"'{_COMPLETIONS.get(previous, 'on-completion')}'\n"
    )
    return _drain_usage(name)


@dataclass
class _DrainArgs:
    """What the command line asks for; ``on_completion`` is a key of ``_COMPLETION_NAMES``"""

    target: str = ""
    cancel: bool = False
    how: str = "graceful"
    on_completion: int = 0
    reason: str | None = None
    request_id: str | None = None
    check: str | None = None
    start: str | None = None
    pool: str | None = None
    verbose: bool = False


@dataclass(frozen=True)
class _Option:
    """One option: ``-name`` abbreviated to at least ``min_len``, setting ``field``"""

    name: str
    min_len: int
    field: str
    value: object = None  # the constant it sets; ``None``: it takes the next argument


# in drain.cpp's order, which decides what an ambiguous abbreviation means
_OPTIONS = (
    _Option("verbose", 4, "verbose", True),
    _Option("pool", 1, "pool"),
    _Option("cancel", 1, "cancel", True),
    _Option("fast", 1, "how", "fast"),
    _Option("quick", 1, "how", "quick"),
    _Option("graceful", 1, "how", "graceful"),
    _Option("resume-on-completion", 1, "on_completion", 1),
    _Option("exit-on-completion", 2, "on_completion", 2),
    _Option("restart-on-completion", 4, "on_completion", 3),
    _Option("reconfig-on-completion", 3, "on_completion", 4),
    _Option("reason", 3, "reason"),
    _Option("request-id", 3, "request_id"),
    _Option("check", 2, "check"),
    _Option("start", 5, "start"),
)


def _is_debug(arg: str) -> bool:
    return is_dash_arg_prefix(arg, "debug", 3) or arg.startswith("-debug:")


def _option_of(arg: str) -> _Option | None:
    return next((o for o in _OPTIONS if is_dash_arg_prefix(arg, o.name, o.min_len)), None)


def _parse_drain_args(name: str, argv: list[str]) -> _DrainArgs | int:
    """The parsed command line, or the exit code of ``-help``, ``-version`` or a usage error"""
    args = _DrainArgs()
    i = 1
    while i < len(argv):
        arg = argv[i]
        if is_dash_arg_prefix(arg, "help", 1):
            return _drain_usage(name)
        if is_dash_arg_prefix(arg, "version", 1):
            print_out("$CondorVersion: emulated $\n$CondorPlatform: emulated $\n")
            return 0
        if _is_debug(arg):
            i += 1
            continue
        option = _option_of(arg)
        if option is None:
            if not arg.startswith("-"):
                break
            print_err(f"ERROR: unexpected argument: {arg}\n")
            return 2
        if option.value is None:
            if i + 1 >= len(argv):
                return _another(name, arg)
            i += 1
            setattr(args, option.field, argv[i])
        elif option.field == "on_completion" and args.on_completion:
            return _conflict(name, arg, args.on_completion)
        else:
            setattr(args, option.field, option.value)
        i += 1
    if i != len(argv) - 1:
        print_err("ERROR: must specify one target machine\n")
        return 2
    args.target = argv[i]
    return args


def _misuse_of_cancel(args: _DrainArgs) -> str | None:
    """The error for an option that ``-cancel`` excludes (or requires), if one is given"""
    if not args.cancel and args.request_id is not None:
        return "ERROR: -request-id may only be used with -cancel\n"
    if not args.cancel:
        return None
    if args.check is not None:
        return "ERROR: -check may not be used with -cancel\n"
    if args.on_completion:
        return "ERROR: cannot use an -on-completion option with -cancel\n"
    if args.reason is not None:
        return "ERROR: cannot use -reason with -cancel\n"
    return None


def _locate_startd(
    target: str, pool: str | None, located: dict[str, Any] | None
) -> tuple[str, str, dict[str, Any] | None] | None:
    """
    The startd's address, its name, and the master's ``locate`` reply if the command can
    reach it; ``None`` if ``target`` names no known startd

    A sinful string is used as given; a name must be the local startd's (no collector here).
    """
    if not (target.startswith("<") and target.endswith(">")):
        if located is None or pool is not None or target not in (located["name"],):
            return None
        return str(located["address"]), str(located["name"]), located
    startd = str(located["name"]) if located else target
    if located is None or located["address"] != target or not located["running"]:
        located = None
    return target, startd, located


def _send_drain(config: Config, args: _DrainArgs) -> dict[str, Any] | None:
    if args.cancel:
        return ask_master(config, "cancel_drain", request_id=args.request_id)
    return ask_master(
        config,
        "drain",
        how=args.how,
        on_completion=_COMPLETION_NAMES[args.on_completion],
        reason=args.reason if args.reason is not None else "by command",
        check=args.check,
        start=args.start,
    )


def _report(args: _DrainArgs, address: str, startd: str, reply: dict[str, Any] | None) -> int:
    """Print what the real tool prints for ``reply`` and return its exit code"""
    command = "CANCEL_DRAIN_JOBS" if args.cancel else "DRAIN_JOBS"
    if reply is None or reply.get("unreachable"):
        print_err(
            f"Attempt to send {command} to startd {address} failed\n"
            f"Failed to start {command} command to {startd}\n"
        )
        return 1
    if not reply.get("ok"):
        print_err(
            f"Attempt to send {command} to startd {address} failed\n"
            f"Received failure from {startd} in response to {command} request: "
            f"error code {reply.get('error_code', 0)}: {reply.get('error', '')}\n"
        )
        return 1
    if args.cancel:
        print_out(f"Sent request to cancel draining on {startd}\n")
    else:
        print_out(
            f"Sent request to drain the startd {address} with {startd}. This only affects the "
            "single startd; any other startds running on the same host will not be drained.\n"
        )
        if args.verbose and reply.get("request_id"):
            print_out(f"\tRequest id: {reply['request_id']}\n")
    return 0


def drain_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    name = argv[0] if argv else "condor_drain"
    args = _parse_drain_args(name, argv)
    if isinstance(args, int):
        return args
    misuse = _misuse_of_cancel(args)
    if misuse is not None:
        print_err(misuse)
        return 2
    config = load_config("condor_drain")
    if config is None:
        return 1
    found = _locate_startd(args.target, args.pool, ask_master(config, "locate"))
    if found is None:
        print_err(f"ERROR: Can't find address for startd {args.target}\n")
        return 1
    address, startd, located = found
    reply = _send_drain(config, args) if located is not None else None
    return _report(args, address, startd, reply)
