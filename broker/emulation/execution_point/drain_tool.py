"""The fake ``condor_drain``, as ``src/condor_tools/drain.cpp`` parses and answers"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

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


def drain_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    name = argv[0] if argv else "condor_drain"
    cancel = False
    how = "graceful"
    on_completion = 0
    reason: str | None = None
    request_id: str | None = None
    check: str | None = None
    start: str | None = None
    pool: str | None = None
    verbose = False
    i = 1
    while i < len(argv):
        arg = argv[i]
        if is_dash_arg_prefix(arg, "help", 1):
            return _drain_usage(name)
        elif is_dash_arg_prefix(arg, "version", 1):
            print_out("$CondorVersion: emulated $\n$CondorPlatform: emulated $\n")
            return 0
        elif is_dash_arg_prefix(arg, "debug", 3) or arg.startswith("-debug:"):
            pass
        elif is_dash_arg_prefix(arg, "verbose", 4):
            verbose = True
        elif is_dash_arg_prefix(arg, "pool", 1):
            if i + 1 >= len(argv):
                return _another(name, arg)
            i += 1
            pool = argv[i]
        elif is_dash_arg_prefix(arg, "cancel", 1):
            cancel = True
        elif is_dash_arg_prefix(arg, "fast", 1):
            how = "fast"
        elif is_dash_arg_prefix(arg, "quick", 1):
            how = "quick"
        elif is_dash_arg_prefix(arg, "graceful", 1):
            how = "graceful"
        elif is_dash_arg_prefix(arg, "resume-on-completion", 1):
            if on_completion:
                return _conflict(name, arg, on_completion)
            on_completion = 1
        elif is_dash_arg_prefix(arg, "exit-on-completion", 2):
            if on_completion:
                return _conflict(name, arg, on_completion)
            on_completion = 2
        elif is_dash_arg_prefix(arg, "restart-on-completion", 4):
            if on_completion:
                return _conflict(name, arg, on_completion)
            on_completion = 3
        elif is_dash_arg_prefix(arg, "reconfig-on-completion", 3):
            if on_completion:
                return _conflict(name, arg, on_completion)
            on_completion = 4
        elif is_dash_arg_prefix(arg, "reason", 3):
            if i + 1 >= len(argv):
                return _another(name, arg)
            i += 1
            reason = argv[i]
        elif is_dash_arg_prefix(arg, "request-id", 3):
            if i + 1 >= len(argv):
                return _another(name, arg)
            i += 1
            request_id = argv[i]
        elif is_dash_arg_prefix(arg, "check", 2):
            if i + 1 >= len(argv):
                return _another(name, arg)
            i += 1
            check = argv[i]
        elif is_dash_arg_prefix(arg, "start", 5):
            if i + 1 >= len(argv):
                return _another(name, arg)
            i += 1
            start = argv[i]
        elif not arg.startswith("-"):
            break
        else:
            print_err(f"ERROR: unexpected argument: {arg}\n")
            return 2
        i += 1
    if i != len(argv) - 1:
        print_err("ERROR: must specify one target machine\n")
        return 2
    target = argv[i]
    if not cancel and request_id is not None:
        print_err("ERROR: -request-id may only be used with -cancel\n")
        return 2
    if cancel:
        if check is not None:
            print_err("ERROR: -check may not be used with -cancel\n")
            return 2
        if on_completion:
            print_err("ERROR: cannot use an -on-completion option with -cancel\n")
            return 2
        if reason is not None:
            print_err("ERROR: cannot use -reason with -cancel\n")
            return 2
    config = load_config("condor_drain")
    if config is None:
        return 1
    located = ask_master(config, "locate")
    # a sinful string is used as given; a name must be the local startd's (no collector here)
    sinful = target.startswith("<") and target.endswith(">")
    if not sinful:
        if located is None or pool is not None or target not in (located["name"],):
            print_err(f"ERROR: Can't find address for startd {target}\n")
            return 1
        address, startd = str(located["address"]), str(located["name"])
    else:
        address = target
        startd = str(located["name"]) if located else target
        if located is None or located["address"] != target or not located["running"]:
            located = None
    command = "CANCEL_DRAIN_JOBS" if cancel else "DRAIN_JOBS"
    reply: dict[str, Any] | None = None
    if located is not None:
        if cancel:
            reply = ask_master(config, "cancel_drain", request_id=request_id)
        else:
            reply = ask_master(
                config,
                "drain",
                how=how,
                on_completion=_COMPLETION_NAMES[on_completion],
                reason=reason if reason is not None else "by command",
                check=check,
                start=start,
            )
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
    if cancel:
        print_out(f"Sent request to cancel draining on {startd}\n")
    else:
        print_out(
            f"Sent request to drain the startd {address} with {startd}. This only affects the "
            "single startd; any other startds running on the same host will not be drained.\n"
        )
        if verbose and reply.get("request_id"):
            print_out(f"\tRequest id: {reply['request_id']}\n")
    return 0
