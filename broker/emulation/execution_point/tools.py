"""
The fake ``condor_*`` executables

Each ``main`` parses its arguments the way the real tool does (option prefixes,
exit codes, messages), asks the emulated master over its control socket and
prints what the real tool prints. Only the invocations the agent uses are
emulated; anything else fails loudly with exit 1 and the words "not emulated".

============================  =====================================================
``condor_master -f``          the emulated execution point, in the foreground
``condor_who -long``          slot ads of the slots that run a job, blank-line separated
``condor_who -wait-for-ready[:N] EXPR``  the master's readiness ad
``condor_drain ...``          as ``src/condor_tools/drain.cpp``: exit 0 accepted, 1 refused
                              or unreachable or help, 2 bad arguments
``condor_update_machine_ad``  one ad from a file or stdin (blank line required), exit 0/1
============================  =====================================================
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker.emulation.execution_point.classad import Ad, ClassAdSyntaxError, evaluate
from broker.emulation.execution_point.config import Config, ConfigError
from broker.emulation.execution_point.paths import MASTER_EXIT_FILE, control_socket_path
from broker.emulation.rpc import EmulatorUnavailable, request_sync


def _err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _state_dir(config: Config) -> Path:
    return Path(config.get("EMULATOR_STATE_DIR") or config.get("LOCAL_DIR") or ".")


def _ask(config: Config, op: str, **fields: Any) -> dict[str, Any] | None:
    """The master's reply, or ``None`` if no emulated master runs"""
    path = control_socket_path(_state_dir(config))
    if not path.exists():
        return None
    try:
        return request_sync(path, {"op": op, **fields})
    except EmulatorUnavailable:
        return None


def _config(tool: str) -> Config | None:
    try:
        return Config.from_environment()
    except ConfigError as err:
        _err(f"{tool} (emulated): {err}\n")
        return None


def is_dash_arg_prefix(arg: str, name: str, min_len: int) -> bool:
    """HTCondor's ``is_dash_arg_prefix``: ``-abbrev`` of ``name``, at least ``min_len`` long"""
    if not arg.startswith("-"):
        return False
    body = arg[2:] if arg.startswith("--") else arg[1:]
    if not body or not name.startswith(body):
        return False
    return len(body) >= (len(name) if min_len < 0 else min_len)


# --------------------------------------------------------------------------- condor_master


def master_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv[1:])
    foreground = False
    while args:
        arg = args.pop(0)
        if arg == "-f":
            foreground = True
        elif arg == "-t":
            pass  # log to the terminal: the emulator logs to stderr anyway
        elif arg == "-n" and args:
            args.pop(0)
        else:
            _err(f"condor_master (emulated): option {arg} is not emulated\n")
            return 1
    if not foreground:
        _err("condor_master (emulated): only -f (stay in the foreground) is emulated\n")
        return 1
    config = _config("condor_master")
    if config is None:
        return 1
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from broker.emulation.execution_point.startd import (
        run_master,  # asyncio only here, not in the quick tools
    )

    return run_master(config)


# --------------------------------------------------------------------------- condor_who


def _who_usage() -> int:
    _err("Usage: condor_who [help-opt] [addr-opt] [display-opt]\n")
    return 1


def who_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv[1:])
    long_form = False
    wait_timeout: int | None = None
    wait_expr = ""
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if not arg.startswith("-"):
            _err(f"condor_who (emulated): target {arg} is not emulated\n")
            return 1
        body, _, colon = arg.lstrip("-").partition(":")
        if is_dash_arg_prefix("-" + body, "help", 1):
            return _who_usage()
        if is_dash_arg_prefix("-" + body, "wait-for-ready", 4):
            if index >= len(args) or args[index].startswith("-"):
                _err(f"Error: Argument {arg} requires a requirements expression\n")
                return 1
            wait_timeout = int(colon) if colon.isdigit() else 0
            wait_expr = args[index]
            index += 1
        elif is_dash_arg_prefix("-" + body, "long", 1) and not colon:
            long_form = True
        else:
            _err(f"condor_who (emulated): option {arg} is not emulated\n")
            return 1
    config = _config("condor_who")
    if config is None:
        return 1
    if wait_timeout is not None:
        return _who_ready(config, wait_timeout, wait_expr)
    if long_form:
        return _who_long(config)
    _err("condor_who (emulated): only -long and -wait-for-ready are emulated\n")
    return 1


def _who_ready(config: Config, timeout_s: int, expr: str) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = _ask(config, "ready_ad")
        if reply is None:
            exit_file = _state_dir(config) / MASTER_EXIT_FILE
            if exit_file.exists():
                info = json.loads(exit_file.read_text())
                _out(f"\nMaster NULL pid={info['pid']} Exited with code={info['exit_code']}\n")
            return 0
        text = str(reply["ad"])
        try:
            satisfied = evaluate(expr, Ad.from_long(text).nodes) is True
        except ClassAdSyntaxError:
            satisfied = True  # the master answers at once: "invalid ReadyRequirements"
        if satisfied or time.monotonic() >= deadline:
            _out(text + "\n")
            return 0
        time.sleep(0.2)


def _who_long(config: Config) -> int:
    path = control_socket_path(_state_dir(config))
    if not path.exists():
        return 0  # no startd address file: nothing to query, nothing printed
    try:
        reply = request_sync(path, {"op": "slot_ads"})
    except EmulatorUnavailable as err:
        _err(f"Error: communication error\nCEDAR:6001:Failed to connect to startd ({err})\n")
        return 1
    for ad in reply.get("ads", []):
        _out(str(ad) + "\n")
    return 0


# --------------------------------------------------------------------------- condor_drain

_COMPLETIONS = {
    1: "-resume-on-completion",
    2: "-exit-on-completion",
    3: "-restart-on-completion",
    4: "-reconfig-on-completion",
}
_COMPLETION_NAMES = {0: "nothing", 1: "resume", 2: "exit", 3: "restart", 4: "reconfig"}


def _drain_usage(name: str) -> int:
    _err(
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
    _err(f"{name}: '{arg}' requires another argument\n")
    return _drain_usage(name)


def _conflict(name: str, arg: str, previous: int) -> int:
    _err(
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
            _out("$CondorVersion: emulated $\n$CondorPlatform: emulated $\n")
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
            _err(f"ERROR: unexpected argument: {arg}\n")
            return 2
        i += 1
    if i != len(argv) - 1:
        _err("ERROR: must specify one target machine\n")
        return 2
    target = argv[i]
    if not cancel and request_id is not None:
        _err("ERROR: -request-id may only be used with -cancel\n")
        return 2
    if cancel:
        if check is not None:
            _err("ERROR: -check may not be used with -cancel\n")
            return 2
        if on_completion:
            _err("ERROR: cannot use an -on-completion option with -cancel\n")
            return 2
        if reason is not None:
            _err("ERROR: cannot use -reason with -cancel\n")
            return 2
    config = _config("condor_drain")
    if config is None:
        return 1
    located = _ask(config, "locate")
    # a sinful string is used as given; a name must be the local startd's (no collector here)
    sinful = target.startswith("<") and target.endswith(">")
    if not sinful:
        if located is None or pool is not None or target not in (located["name"],):
            _err(f"ERROR: Can't find address for startd {target}\n")
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
            reply = _ask(config, "cancel_drain", request_id=request_id)
        else:
            reply = _ask(
                config,
                "drain",
                how=how,
                on_completion=_COMPLETION_NAMES[on_completion],
                reason=reason if reason is not None else "by command",
                check=check,
                start=start,
            )
    if reply is None or reply.get("unreachable"):
        _err(
            f"Attempt to send {command} to startd {address} failed\n"
            f"Failed to start {command} command to {startd}\n"
        )
        return 1
    if not reply.get("ok"):
        _err(
            f"Attempt to send {command} to startd {address} failed\n"
            f"Received failure from {startd} in response to {command} request: "
            f"error code {reply.get('error_code', 0)}: {reply.get('error', '')}\n"
        )
        return 1
    if cancel:
        _out(f"Sent request to cancel draining on {startd}\n")
    else:
        _out(
            f"Sent request to drain the startd {address} with {startd}. This only affects the "
            "single startd; any other startds running on the same host will not be drained.\n"
        )
        if verbose and reply.get("request_id"):
            _out(f"\tRequest id: {reply['request_id']}\n")
    return 0


# --------------------------------------------------------------------------- update_machine_ad


def update_machine_ad_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv if argv is None else argv)
    name: str | None = None
    file: str | None = None
    for arg in args[1:]:
        prefix = len(arg) >= 2 and arg.startswith("-")
        if prefix and "-help".startswith(arg):
            _out(f"{args[0]}: [options] <path/to/update-ad>\n")
            return 0
        if prefix and "-version".startswith(arg):
            return 0
        if prefix and ("-pool".startswith(arg) or "-name".startswith(arg)):
            name = arg  # sic: the real tool stores the option itself, not its value
        else:
            file = arg
    if file is None:
        shown, text = "stdin", sys.stdin.read()
    else:
        shown = file
        try:
            text = Path(file).read_text()
        except OSError as err:
            _err(f"Failed to open '{file}', aborting ({err.errno}: {err.strerror})\n")
            return 1
    lines = text.split("\n")
    body: list[str] = []
    ended = False
    for line in lines[:-1]:  # the part after the last newline is not a complete line
        if not line.strip():
            if body:
                ended = True
                break
            continue
        body.append(line)
    problem = ""
    if not ended:
        problem = "File ended unexpectedly.  Please add a blank line the end of the file.\n"
    elif not body:
        problem = "File was empty.\n"
    else:
        try:
            Ad.from_long("\n".join(body))
        except ClassAdSyntaxError:
            problem = "Syntax error in file.\n"
    if problem:
        _err(f"Failed to parse '{shown}', aborting.\n{problem}")
        return 1
    config = _config("condor_update_machine_ad")
    if config is None:
        return 1
    located = _ask(config, "locate")
    if name is not None or located is None or not located.get("running"):
        wanted = name or "local startd"
        _err(f"Unable to locate startd: Can't find address for {wanted}\n")
        return 1
    reply = _ask(config, "update_machine_ad", ad="\n".join(body) + "\n")
    if reply is None or not reply.get("ok"):
        why = (reply or {}).get("error", "communication error")
        _err(f"Unable to update machine ad: {why}\n")
        return 1
    return 0


TOOLS = {
    "condor_master": "master_main",
    "condor_who": "who_main",
    "condor_drain": "drain_main",
    "condor_update_machine_ad": "update_machine_ad_main",
}
