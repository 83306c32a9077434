"""
Fake central-manager tools, ``condor_status`` and ``condor_drain``, in front of the overlay pool

Its rule: only the invocations TARDIS's own HTCondor batch-system adapter makes are
emulated; anything else fails with exit 1 and the words "not emulated".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.rpc import request_sync
from broker.emulation.site.schedd import install_socket_tools

COLLECTOR = "collector.overlay"
_SUFFIX = ".overlay"


def _ads(socket: Path) -> list[dict[str, Any]] | None:
    try:
        reply = request_sync(socket, {"op": "status"})
    except EmulatorUnavailable as err:
        sys.stderr.write(f"Error: Couldn't contact the condor_collector ({err})\n")
        return None
    ads = []
    for drone, machine in sorted((reply.get("machines") or {}).items()):
        slots, busy = int(machine.get("slots", 0)), int(machine.get("busy", 0))
        ads.append(
            {
                "Name": f"slot1@{drone}{_SUFFIX}",
                "Machine": f"{drone}{_SUFFIX}",
                "State": machine.get("State"),
                "Activity": machine.get("Activity"),
                "TardisDroneUuid": drone,
                "PartitionableSlot": True,
                "TotalSlotCpus": slots,
                "Cpus": slots - busy,
                "TotalSlotMemory": 1024 * slots,
                "Memory": 1024 * (slots - busy),
            }
        )
    return ads


def _format(value: Any) -> str:
    """A value as ``-af`` prints it: strings bare, ``undefined``, reals as HTCondor does"""
    import classad2

    if value is classad2.Value.Undefined:
        return "undefined"
    if value is classad2.Value.Error:
        return "error"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}" if value != int(value) else f"{value:.1f}"
    return str(value)


def condor_status(argv: Sequence[str], socket: Path) -> int:
    """
    ``condor_status -af:t EXPR... -constraint C``: one tab-separated row per startd ad for which
    ``C`` is true, each ``EXPR`` evaluated by HTCondor's own ClassAd library (so TARDIS's ratio
    expressions work as in a real pool); ``-collector -af:t Machine``: the one emulated
    collector; ``-master -af:t ATTR... -constraint C``: its master ad (``DaemonStartTime``)

    A startd's ad: ``Name = "slot1@<drone>.overlay"``, ``Machine``, ``State``, ``Activity``,
    ``TardisDroneUuid``, ``PartitionableSlot = true``, ``TotalSlotCpus``/``Cpus`` and
    ``TotalSlotMemory``/``Memory`` (1024 per slot) with the busy slots taken. The collector
    reports that it has run for two hours, so TARDIS fills its cache afresh on every update.
    """
    import classad2  # HTCondor's own ClassAd library: a test dependency, imported here only

    args = list(argv[1:])
    kind = "startd"
    for flag in ("-collector", "-master"):
        if flag in args:
            args.remove(flag)
            kind = flag[1:]
    constraint = "true"
    if "-constraint" in args:
        at = args.index("-constraint")
        if at + 1 >= len(args):
            sys.stderr.write("condor_status: -constraint requires another argument\n")
            return 1
        constraint = args[at + 1]
        del args[at : at + 2]
    if args[:1] != ["-af:t"] or len(args) < 2:
        sys.stderr.write(f"condor_status: invocation not emulated: {' '.join(argv[1:])}\n")
        return 1
    expressions = args[1:]
    if kind == "startd":
        ads = _ads(socket)
        if ads is None:
            return 1
    else:  # the collector and its master, up for two hours
        ads = [
            {"Machine": COLLECTOR, "Name": COLLECTOR, "DaemonStartTime": int(time.time()) - 7200}
        ]
    try:
        selector = classad2.ExprTree(constraint)
        columns = [classad2.ExprTree(expression) for expression in expressions]
    except Exception as err:  # classad2 raises its own ClassAdException (a ValueError)
        sys.stderr.write(f"condor_status: cannot parse an expression: {err}\n")
        return 1
    rows = []
    for values in ads:
        ad = classad2.ClassAd(values)
        if selector.eval(ad) is not True:
            continue
        rows.append("\t".join(_format(column.eval(ad)) for column in columns))
    sys.stdout.write("".join(row + "\n" for row in rows))
    return 0


def condor_drain(argv: Sequence[str], socket: Path) -> int:
    """``condor_drain -graceful NAME``: ``Sent request to drain NAME``; exit 1 if no such startd"""
    args = list(argv[1:])
    if len(args) != 2 or args[0] != "-graceful":
        sys.stderr.write(f"condor_drain: invocation not emulated: {' '.join(argv[1:])}\n")
        return 1
    name = args[1]
    drone = name.partition("@")[2].removesuffix(_SUFFIX)
    try:
        reply = request_sync(socket, {"op": "drain", "drone": drone, "reason": "condor_drain"})
    except EmulatorUnavailable as err:
        reply = {"ok": False, "error": str(err)}
    if not reply.get("ok"):
        sys.stderr.write(f"Can't find address for startd {name}\n")
        return 1
    sys.stdout.write(f"Sent request to drain {name}\n")
    return 0


TOOLS: dict[str, Callable[[Sequence[str], Path], int]] = {
    "condor_status": condor_status,
    "condor_drain": condor_drain,
}


def install_fake_collector(bin_dir: Path, obs_socket: Path, python: str = sys.executable) -> Path:
    """
    Write the fake central-manager tools into ``bin_dir``, each asking the
    overlay pool on ``obs_socket``; put ``bin_dir`` first in the ``PATH`` of
    whatever runs TARDIS's HTCondor batch-system adapter

    :return: ``bin_dir``
    """
    return install_socket_tools(bin_dir, __name__, list(TOOLS), obs_socket, python)
