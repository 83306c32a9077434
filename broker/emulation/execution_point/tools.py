"""
The fake ``condor_*`` executables of the execution point, in front of the emulated master

Its rule: only the invocations the agent uses are emulated, printed as the real tool
prints them; anything else fails with exit 1 and the words "not emulated".
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from broker.emulation.errors import ClassAdSyntaxError, EmulatorUnavailable
from broker.emulation.execution_point.classad import Ad, evaluate
from broker.emulation.execution_point.config import Config
from broker.emulation.execution_point.drain_tool import drain_main
from broker.emulation.execution_point.paths import MASTER_EXIT_FILE, control_socket_path
from broker.emulation.execution_point.tool_support import (
    ask_master,
    is_dash_arg_prefix,
    load_config,
    print_err,
    print_out,
    state_dir_of,
)
from broker.emulation.rpc import request_sync

# --------------------------------------------------------------------------- condor_master


def master_main(argv: Sequence[str] | None = None) -> int:
    """``condor_master -f``: the emulated execution point, in the foreground"""
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
            print_err(f"condor_master (emulated): option {arg} is not emulated\n")
            return 1
    if not foreground:
        print_err("condor_master (emulated): only -f (stay in the foreground) is emulated\n")
        return 1
    config = load_config("condor_master")
    if config is None:
        return 1
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from broker.emulation.execution_point.startd import (
        run_master,  # asyncio only here, not in the quick tools
    )

    return run_master(config)


# --------------------------------------------------------------------------- condor_who


def _who_usage() -> int:
    print_err("Usage: condor_who [help-opt] [addr-opt] [display-opt]\n")
    return 1


def who_main(argv: Sequence[str] | None = None) -> int:
    """
    ``condor_who -long``: the slot ads of the slots that run a job, blank-line separated;
    ``condor_who -wait-for-ready[:N] EXPR``: the master's readiness ad
    """
    args = list(sys.argv[1:] if argv is None else argv[1:])
    long_form = False
    wait_timeout: int | None = None
    wait_expr = ""
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if not arg.startswith("-"):
            print_err(f"condor_who (emulated): target {arg} is not emulated\n")
            return 1
        body, _, colon = arg.lstrip("-").partition(":")
        if is_dash_arg_prefix("-" + body, "help", 1):
            return _who_usage()
        if is_dash_arg_prefix("-" + body, "wait-for-ready", 4):
            if index >= len(args) or args[index].startswith("-"):
                print_err(f"Error: Argument {arg} requires a requirements expression\n")
                return 1
            wait_timeout = int(colon) if colon.isdigit() else 0
            wait_expr = args[index]
            index += 1
        elif is_dash_arg_prefix("-" + body, "long", 1) and not colon:
            long_form = True
        else:
            print_err(f"condor_who (emulated): option {arg} is not emulated\n")
            return 1
    config = load_config("condor_who")
    if config is None:
        return 1
    if wait_timeout is not None:
        return _who_ready(config, wait_timeout, wait_expr)
    if long_form:
        return _who_long(config)
    print_err("condor_who (emulated): only -long and -wait-for-ready are emulated\n")
    return 1


def _who_ready(config: Config, timeout_s: int, expr: str) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = ask_master(config, "ready_ad")
        if reply is None:
            exit_file = state_dir_of(config) / MASTER_EXIT_FILE
            if exit_file.exists():
                info = json.loads(exit_file.read_text())
                print_out(f"\nMaster NULL pid={info['pid']} Exited with code={info['exit_code']}\n")
            return 0
        text = str(reply["ad"])
        try:
            satisfied = evaluate(expr, Ad.from_long(text).nodes) is True
        except ClassAdSyntaxError:
            satisfied = True  # the master answers at once: "invalid ReadyRequirements"
        if satisfied or time.monotonic() >= deadline:
            print_out(text + "\n")
            return 0
        time.sleep(0.2)


def _who_long(config: Config) -> int:
    path = control_socket_path(state_dir_of(config))
    if not path.exists():
        return 0  # no startd address file: nothing to query, nothing printed
    try:
        reply = request_sync(path, {"op": "slot_ads"})
    except EmulatorUnavailable as err:
        print_err(f"Error: communication error\nCEDAR:6001:Failed to connect to startd ({err})\n")
        return 1
    for ad in reply.get("ads", []):
        print_out(str(ad) + "\n")
    return 0


# --------------------------------------------------------------------------- update_machine_ad


def update_machine_ad_main(argv: Sequence[str] | None = None) -> int:
    """``condor_update_machine_ad``: one ad from a file or stdin (blank line required), exit 0/1"""
    args = list(sys.argv if argv is None else argv)
    name: str | None = None
    file: str | None = None
    for arg in args[1:]:
        prefix = len(arg) >= 2 and arg.startswith("-")
        if prefix and "-help".startswith(arg):
            print_out(f"{args[0]}: [options] <path/to/update-ad>\n")
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
            print_err(f"Failed to open '{file}', aborting ({err.errno}: {err.strerror})\n")
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
        print_err(f"Failed to parse '{shown}', aborting.\n{problem}")
        return 1
    config = load_config("condor_update_machine_ad")
    if config is None:
        return 1
    located = ask_master(config, "locate")
    if name is not None or located is None or not located.get("running"):
        wanted = name or "local startd"
        print_err(f"Unable to locate startd: Can't find address for {wanted}\n")
        return 1
    reply = ask_master(config, "update_machine_ad", ad="\n".join(body) + "\n")
    if reply is None or not reply.get("ok"):
        why = (reply or {}).get("error", "communication error")
        print_err(f"Unable to update machine ad: {why}\n")
        return 1
    return 0


TOOLS = {
    "condor_master": "master_main",
    "condor_who": "who_main",
    "condor_drain": "drain_main",
    "condor_update_machine_ad": "update_machine_ad_main",
}

__all__ = ["TOOLS", "drain_main", "master_main", "update_machine_ad_main", "who_main"]
