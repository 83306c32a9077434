"""
Fake schedd tools (``condor_submit``, ``condor_q``, ``condor_rm``, ``condor_suspend``) for the LBS

Its rule: only the invocations TARDIS's own HTCondor site adapter makes are emulated, printed
as the real tool prints them as far as the adapter reads it; anything else fails with exit 1
and the words "not emulated".
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.rpc import request_sync

#: HTCondor JobStatus of the emulated local batch system's jobs
_JOB_ID = re.compile(r"^(\d+)(?:\.(\d+))?$")
_QUEUE = re.compile(r"^queue(?:\s+(\d+))?\s*$", re.IGNORECASE)


def _ask(socket: Path, request: dict[str, Any]) -> dict[str, Any] | None:
    try:
        reply = request_sync(socket, request)
    except EmulatorUnavailable as err:
        sys.stderr.write(f"ERROR: Can't find address of local schedd ({err})\n")
        return None
    return reply


def _not_emulated(tool: str, argv: Sequence[str]) -> int:
    sys.stderr.write(f"{tool}: invocation not emulated: {' '.join(argv[1:])}\n")
    return 1


def _job_ids(args: Sequence[str]) -> list[str] | None:
    ids = []
    for arg in args:
        match = _JOB_ID.match(arg)
        if match is None:
            return None
        ids.append(f"{match[1]}.{match[2] or 0}")
    return ids


def parse_environment(value: str) -> dict[str, str]:
    """
    The submit command ``environment``: old syntax ``A=1;B=2``, or the new
    syntax ``"A=1 B=2"`` without quoted values

    :raises ValueError: a form the emulation does not read
    """
    value = value.strip()
    if value.startswith('"'):
        if not value.endswith('"') or "'" in value:
            raise ValueError(f"environment not emulated: {value}")
        items = value[1:-1].split()
    else:
        items = [item for item in value.split(";") if item.strip()]
    env = {}
    for item in items:
        name, sep, text = item.strip().partition("=")
        if not sep or not name:
            raise ValueError(f"not NAME=VALUE in environment: {item!r}")
        env[name] = text
    return env


def parse_submit(text: str) -> list[dict[str, str]]:
    """
    The jobs a submit description queues: the commands in force at each ``queue``

    Commands are ``key = value`` (keys case-insensitive); ``#`` lines are comments.

    :raises ValueError: a line the emulation does not read
    """
    commands: dict[str, str] = {}
    jobs: list[dict[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        queue = _QUEUE.match(line)
        if queue is not None:
            jobs.extend(dict(commands) for _ in range(int(queue[1] or 1)))
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"not a submit command: {line!r}")
        commands[key.strip().lower()] = value.strip()
    return jobs


def condor_submit(argv: Sequence[str], socket: Path) -> int:
    """
    ``condor_submit -verbose -maxjobs N``: the submit description on stdin, one job per ``queue``
    statement; per job ``** Proc C.P:`` and its ad; exit 1 and a message on errors

    Each job gets a cluster of its own (``C.0``), where one real ``condor_submit`` of several
    jobs makes one cluster with several procs.
    """
    args = list(argv[1:])
    if "-verbose" not in args:
        return _not_emulated("condor_submit", argv)
    args.remove("-verbose")
    if args[:1] == ["-maxjobs"] and len(args) >= 2 and args[1].isdigit():
        args = args[2:]
    if args:  # submit options or a file name: not what TARDIS's adapter sends here
        return _not_emulated("condor_submit", argv)
    try:
        jobs = parse_submit(sys.stdin.read())
        environments = [parse_environment(job.get("environment", "")) for job in jobs]
    except ValueError as err:
        sys.stderr.write(f"ERROR: {err}\n")
        return 1
    if not jobs:
        sys.stderr.write("ERROR: no queue statement: no jobs submitted\n")
        return 1
    out = ["Submitting job(s)."]
    for job, env in zip(jobs, environments, strict=True):
        drone = env.get("TardisDroneUuid", "")
        reply = _ask(
            socket,
            {"op": "submit", "drone": drone, "env": env, "executable": job.get("executable", "")},
        )
        if reply is None or not reply.get("ok"):
            sys.stderr.write("ERROR: Failed to submit job\n")
            return 1
        cluster, proc = str(reply["job_id"]).split(".")
        out += [
            f"** Proc {cluster}.{proc}:",
            f'Cmd = "{job.get("executable", "")}"',
            f"ClusterId = {cluster}",
            f'Environment = "{" ".join(f"{k}={v}" for k, v in env.items())}"',
            "JobStatus = 1",
            f"ProcId = {proc}",
            f"RequestCpus = {job.get('request_cpus', '1')}",
            "",
        ]
    out.append(f"{len(jobs)} job(s) submitted.")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def condor_q(argv: Sequence[str], socket: Path) -> int:
    """
    ``condor_q ID... -af:t ATTR...``: a tab-separated row per job still in the queue
    (``JobStatus``, ``ClusterId``, ``ProcId``; other attributes ``undefined``)
    """
    args = list(argv[1:])
    for flag in ("-af:t", "-af"):
        if flag in args:
            at = args.index(flag)
            ids, attributes, separator = args[:at], args[at + 1 :], "\t" if ":t" in flag else " "
            break
    else:
        return _not_emulated("condor_q", argv)
    job_ids = _job_ids(ids)
    if job_ids is None or not attributes:
        return _not_emulated("condor_q", argv)
    reply = _ask(socket, {"op": "q"})
    if reply is None:
        return 1
    queue = {str(job_id): int(status) for job_id, status in reply.get("jobs", {}).items()}
    wanted = job_ids or sorted(queue, key=lambda j: tuple(map(int, j.split("."))))
    rows = []
    for job_id in wanted:
        if job_id not in queue:
            continue
        cluster, proc = job_id.split(".")
        values = {"JobStatus": str(queue[job_id]), "ClusterId": cluster, "ProcId": proc}
        rows.append(separator.join(values.get(name, "undefined") for name in attributes))
    sys.stdout.write("".join(row + "\n" for row in rows))
    return 0


def _tool(argv: Sequence[str], socket: Path, op: str, done: str, not_running: str) -> int:
    tool = Path(argv[0]).name
    job_ids = _job_ids(argv[1:])
    if not job_ids:
        return _not_emulated(tool, argv)
    queue_reply = _ask(socket, {"op": "q"})
    reply = _ask(socket, {"op": op, "job_ids": job_ids})
    if queue_reply is None or reply is None:
        return 1
    queued = set(queue_reply.get("jobs", {}))
    succeeded = 0
    for job_id in job_ids:
        if reply.get("done", {}).get(job_id):
            sys.stdout.write(f"Job {job_id} {done}\n")
            succeeded += 1
        elif job_id in queued:
            sys.stderr.write(f"Job {job_id} {not_running}\n")
        else:
            sys.stderr.write(f"Job {job_id} not found\n")
    return 0 if succeeded else 1


def condor_rm(argv: Sequence[str], socket: Path) -> int:
    """
    ``condor_rm ID...``: ``Job C.P marked for removal`` on stdout, ``Job C.P not found`` on
    stderr; exit 1 when no job was removed
    """
    return _tool(argv, socket, "rm", "marked for removal", "already marked for removal")


def condor_suspend(argv: Sequence[str], socket: Path) -> int:
    """
    ``condor_suspend ID...``: ``Job C.P suspended``; ``... not running to be suspended`` or
    ``... not found`` on stderr
    """
    return _tool(argv, socket, "suspend", "suspended", "not running to be suspended")


TOOLS: dict[str, Callable[[Sequence[str], Path], int]] = {
    "condor_submit": condor_submit,
    "condor_q": condor_q,
    "condor_rm": condor_rm,
    "condor_suspend": condor_suspend,
}


def install_fake_schedd(bin_dir: Path, lbs_socket: Path, python: str = sys.executable) -> Path:
    """
    Write the fake schedd tools into ``bin_dir``, each asking the local batch
    system on ``lbs_socket``; put ``bin_dir`` first in the ``PATH`` of whatever
    runs TARDIS's HTCondor site adapter

    :return: ``bin_dir``
    """
    return install_socket_tools(bin_dir, __name__, list(TOOLS), lbs_socket, python)


def install_socket_tools(
    bin_dir: Path, module: str, tools: Sequence[str], socket: Path, python: str
) -> Path:
    """Scripts in ``bin_dir`` running ``module.TOOLS[name](argv, socket)``, one per tool"""
    bin_dir = Path(bin_dir).resolve()
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        script = bin_dir / tool
        script.write_text(
            f"#!{python}\n"
            f"# fake {tool} for tests: see {module.replace('.', '/')}.py\n"
            "import sys\n"
            "from pathlib import Path\n"
            f"from {module} import TOOLS\n"
            f"sys.exit(TOOLS[{tool!r}](sys.argv, Path({str(socket)!r})))\n"
        )
        script.chmod(0o755)
    return bin_dir
