"""
HTCondor starter job hooks that ask the agent's gate (``docs/htcondor.md``, "The hooks")

``prepare-job`` never exits non-zero and never prints a refusal code below 300: either
would put the user's job on hold. An agent it cannot ask is a refusal
(:data:`~remote_agent.interfaces.AGENT_UNREACHABLE_STATUS`). ``python -m remote_agent.hooks``
runs the same commands without importing the rest of the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Final, TextIO

from remote_agent.classad import ClassAd, parse_ad, quote
from remote_agent.errors import GateUnavailable
from remote_agent.gate.client import ask
from remote_agent.gate.messages import (
    MAX_REQUEST_NAME,
    GateAck,
    GateDecisionReply,
    GateErrorReply,
    JobExitRequest,
    PrepareJobRequest,
)
from remote_agent.gate.paths import find_gate_path
from remote_agent.interfaces import AGENT_UNREACHABLE_STATUS
from remote_agent.jobruntime import RUNTIME_ENV, parse_attributes, requested_runtime
from remote_agent.protocol.events import PayloadEnd

log = logging.getLogger(__name__)

#: the hook keyword the drone's startd forces with ``STARTER_JOB_HOOK_KEYWORD``
HOOK_KEYWORD: Final = "COBALD_REMOTE"
#: environment variable overriding the hooks' wait for the agent, in seconds
TIMEOUT_ENV: Final = "COBALD_REMOTE_GATE_TIMEOUT"
#: how long a hook waits for the agent by default, in seconds
DEFAULT_TIMEOUT_S: Final = 5.0
#: the most of the job ad a hook reads from stdin, in bytes
MAX_AD_BYTES: Final = 1 << 20
#: the JOB_EXIT reasons HTCondor passes as the first argument
EXIT_REASONS: Final = tuple(end.value for end in PayloadEnd if end is not PayloadEnd.UNKNOWN)


def read_ad(stream: BinaryIO) -> ClassAd:
    """The job ad HTCondor writes to a hook's stdin (at most :data:`MAX_AD_BYTES`)"""
    data = stream.read(MAX_AD_BYTES)
    return parse_ad(data.decode("utf-8", errors="replace"))


def job_id_of(ad: ClassAd) -> str:
    """``<ClusterId>.<ProcId>``, else from ``GlobalJobId``, else ``"unknown"``"""
    cluster, proc = ad.integer("ClusterId"), ad.integer("ProcId")
    if cluster is not None and proc is not None:
        return f"{cluster}.{proc}"
    global_id = ad.string("GlobalJobId") or ""
    parts = global_id.split("#")
    if len(parts) >= 2 and parts[1]:
        return parts[1]
    return "unknown"


def _timeout(value: float | None, environ: Mapping[str, str]) -> float:
    if value is not None:
        return value
    try:
        return float(environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def runtime_of(ad: ClassAd, environ: Mapping[str, str]) -> float | None:
    """
    The runtime ``ad`` requests or expects, in seconds, by the attributes the agent names
    (:data:`~remote_agent.jobruntime.RUNTIME_ENV`); ``None`` if it names none or the ad
    carries none of them
    """
    try:
        attributes = parse_attributes(environ.get(RUNTIME_ENV, ""))
    except ValueError as err:
        log.warning("ignoring %s: %s", RUNTIME_ENV, err)
        return None
    return requested_runtime(ad, attributes)


def _refusal(code: int, message: str) -> list[str]:
    return [f"HookStatusCode = {code}", f"HookStatusMessage = {quote(message)}"]


def prepare_job(
    ad: ClassAd,
    *,
    socket_path: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    environ: Mapping[str, str] = os.environ,
) -> list[str]:
    """
    Ask the agent about the job in ``ad``; the lines to print (none: allowed)

    Never raises: anything that keeps the agent from deciding is a refusal with
    :data:`~remote_agent.interfaces.AGENT_UNREACHABLE_STATUS`.
    """
    job_id = job_id_of(ad)
    path = socket_path or find_gate_path(environ)
    if path is None:
        log.warning("no gate socket found for job %s; refusing", job_id)
        return _refusal(AGENT_UNREACHABLE_STATUS, "cobald-remote agent not found; job back to idle")
    request = PrepareJobRequest(
        job_id=job_id,
        slot=(ad.string("RemoteHost") or "")[:MAX_REQUEST_NAME],
        owner=(ad.string("Owner") or ad.string("User") or "")[:MAX_REQUEST_NAME],
        requested_s=runtime_of(ad, environ),
    )
    try:
        reply = ask(path, request, timeout_s)
    except GateUnavailable as err:
        log.warning("%s; refusing job %s", err, job_id)
        return _refusal(
            AGENT_UNREACHABLE_STATUS, "cobald-remote agent unreachable; job back to idle"
        )
    if isinstance(reply, GateDecisionReply):
        if reply.allow:
            return []
        # the gate never sends < 300, but a hold must be impossible whatever arrives
        code = reply.status_code if reply.status_code >= 300 else AGENT_UNREACHABLE_STATUS
        return _refusal(code, reply.message or "refused by the cobald-remote agent")
    error = reply.error if isinstance(reply, GateErrorReply) else f"unexpected reply {reply!r}"
    log.warning("the agent did not decide on job %s: %s", job_id, error)
    return _refusal(AGENT_UNREACHABLE_STATUS, f"cobald-remote agent could not decide: {error}")


def job_exit(
    ad: ClassAd,
    reason: str,
    *,
    socket_path: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Tell the agent that the job in ``ad`` ended for ``reason``; whether it heard"""
    job_id = job_id_of(ad)
    how = PayloadEnd(reason) if reason in EXIT_REASONS else PayloadEnd.UNKNOWN
    if how is PayloadEnd.UNKNOWN:
        log.warning("unknown JOB_EXIT reason %r for job %s", reason, job_id)
    exit_code = ad.integer("ExitCode")
    signal = ad.integer("ExitSignal")
    if ad.boolean("ExitBySignal") and signal is not None:
        exit_code = -signal
    duration = ad.real("JobDuration")
    request = JobExitRequest(
        job_id=job_id,
        how=how,
        exit_code=exit_code,
        duration_s=duration if duration is not None and duration >= 0 else None,
    )
    path = socket_path or find_gate_path(environ)
    if path is None:
        log.warning("no gate socket found; end of job %s not reported", job_id)
        return False
    try:
        reply = ask(path, request, timeout_s)
    except GateUnavailable as err:
        log.warning("%s; end of job %s not reported", err, job_id)
        return False
    if not isinstance(reply, GateAck):
        log.warning("the agent did not take the end of job %s: %r", job_id, reply)
        return False
    return True


def run_prepare_job(
    args: argparse.Namespace,
    stdin: BinaryIO | None = None,
    stdout: TextIO | None = None,
) -> int:
    """``hook prepare-job``: always exit 0 (see the module doc)"""
    out = stdout or sys.stdout
    try:
        ad = read_ad(stdin or sys.stdin.buffer)
        lines = prepare_job(
            ad, socket_path=args.socket, timeout_s=_timeout(args.timeout, os.environ)
        )
    except Exception:
        log.exception("prepare-job hook failed; refusing")
        lines = _refusal(AGENT_UNREACHABLE_STATUS, "cobald-remote hook failed; job back to idle")
    for line in lines:
        print(line, file=out)
    out.flush()
    return 0


def run_job_exit(args: argparse.Namespace, stdin: BinaryIO | None = None) -> int:
    """``hook job-exit REASON``: always exit 0"""
    try:
        ad = read_ad(stdin or sys.stdin.buffer)
        job_exit(
            ad, args.reason, socket_path=args.socket, timeout_s=_timeout(args.timeout, os.environ)
        )
    except Exception:
        log.exception("job-exit hook failed")
    return 0


_Subparsers = argparse._SubParsersAction  # argparse exposes no public name for it


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", type=Path, help="gate socket (default: $COBALD_REMOTE_GATE)")
    parser.add_argument(
        "--timeout",
        type=float,
        help=f"seconds to wait for the agent (default ${TIMEOUT_ENV} or {DEFAULT_TIMEOUT_S:g})",
    )


def _add_hooks(commands: _Subparsers[argparse.ArgumentParser]) -> None:
    prepare = commands.add_parser(
        "prepare-job",
        help="HOOK_PREPARE_JOB: ask the agent whether the payload on stdin may start",
    )
    _add_common(prepare)
    prepare.set_defaults(run=run_prepare_job)
    exited = commands.add_parser(
        "job-exit", help="HOOK_JOB_EXIT: tell the agent that the payload on stdin ended"
    )
    exited.add_argument("reason", nargs="?", default="", metavar="|".join(EXIT_REASONS))
    _add_common(exited)
    exited.set_defaults(run=run_job_exit)


def add_hook_commands(agent_subparsers: _Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``hook prepare-job`` and ``hook job-exit`` below ``cobald-remote agent``"""
    hook = agent_subparsers.add_parser(
        "hook", help="HTCondor job hooks that ask the agent's gate (deploy/htcondor/)"
    )
    _add_hooks(hook.add_subparsers(dest="hook", required=True, metavar="HOOK"))


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m remote_agent.hooks``"""
    parser = argparse.ArgumentParser(
        prog="python -m remote_agent.hooks",
        description="HTCondor job hooks of cobald-remote (the light-weight entry point)",
    )
    _add_hooks(parser.add_subparsers(dest="hook", required=True, metavar="HOOK"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
