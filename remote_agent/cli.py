"""
``cobald-remote agent ...``: the drone job's entry point

``agent run [options] -- WORKER_COMMAND...`` runs the :class:`~remote_agent.agent.Agent`
around the worker; ``agent hook ...`` (from :mod:`remote_agent.hooks`) are the
commands the startd's job hooks run. ``broker/cli.py`` adds this group to the
``cobald-remote`` parser with :func:`add_commands`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
from pathlib import Path

from remote_agent.errors import AgentError, SettingsError
from remote_agent.hooks import add_hook_commands
from remote_agent.interfaces import Startd
from remote_agent.logs import JsonLines
from remote_agent.options import add_options, from_args
from remote_agent.settings import Settings

log = logging.getLogger(__name__)

#: exit code for a configuration the agent cannot run with (as argparse uses)
EXIT_USAGE = 2
#: exit code when the agent itself fails (spool locked, gate socket unusable, ...)
EXIT_AGENT_ERROR = 1


def add_commands(agent: argparse.ArgumentParser) -> None:
    """Add the ``agent`` group's commands (``run`` and ``hook ...``)"""
    commands = agent.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="supervise WORKER_COMMAND, publish the drone's lifecycle, obey commands",
        usage="cobald-remote agent run [options] -- WORKER_COMMAND...",
        description="Run the drone agent around WORKER_COMMAND (normally condor_master -f). "
        'Options default to the environment variables in brackets (docs: agent, "Configuration").',
    )
    add_options(run)
    run.add_argument(
        "--log-format", choices=["json", "text"], default="json", help="log lines (default json)"
    )
    run.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="least severity logged (default info)",
    )
    run.add_argument("worker", nargs=argparse.REMAINDER, metavar="-- WORKER_COMMAND...")
    run.set_defaults(run=run_agent)
    add_hook_commands(commands)


def _configure_logging(args: argparse.Namespace) -> None:
    root = logging.getLogger()
    root.setLevel(getattr(logging, args.log_level.upper()))
    if args.log_format == "json":
        for handler in root.handlers or [logging.StreamHandler(sys.stderr)]:
            handler.setFormatter(JsonLines())
            if handler not in root.handlers:
                root.addHandler(handler)


def run_agent(args: argparse.Namespace) -> int:
    """``agent run``: the exit code is the worker's (see docs/agent.md for the others)"""
    import asyncio  # not for ``--help``

    _configure_logging(args)
    try:
        settings = from_args(args)
    except SettingsError as err:
        print(f"cobald-remote agent: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(serve(settings))
    except AgentError as err:
        print(f"cobald-remote agent: {err}", file=sys.stderr)
        return EXIT_AGENT_ERROR


async def serve(settings: Settings) -> int:
    """Run the agent with the real startd (unless ``--no-startd``) and the gate socket"""
    from remote_agent.agent import Agent
    from remote_agent.gate.server import GateServer

    startd: Startd | None = None
    if settings.startd:
        # the HTCondor side lives in its own module; imported only when it is used
        from remote_agent.htcondor import CondorStartd

        startd = CondorStartd()
    agent = Agent(settings, startd=startd)
    gate = GateServer(settings.gate_socket, agent)
    # the worker's daemons, their starters and the hooks inherit where the gate is
    agent.worker_env.update(gate.environment())
    # disk I/O (the spool may be on a slow disk): not on the loop
    made = not await asyncio.to_thread(os.path.lexists, settings.spool_dir)
    await gate.start()
    try:
        return await agent.run(handle_signals=True)
    finally:
        await gate.close()
        if made:
            await asyncio.to_thread(_remove_spool_dir, settings.spool_dir, agent.unpublished)


def _remove_spool_dir(directory: Path, unpublished: int | None) -> None:
    """
    Remove the spool directory this run made, unless it holds what a restarted agent needs

    A batch system that keeps no per-job scratch directory (Slurm without
    ``job_container/tmpfs``) would keep it, the drone's key included, after the job.
    """
    if unpublished is None:  # the agent did not get to run: nothing to tell
        return
    if unpublished:
        log.warning(
            "keeping %s: %d events unpublished, for an agent started again there",
            directory,
            unpublished,
        )
        return
    shutil.rmtree(directory, ignore_errors=True)
    if os.path.lexists(directory):
        log.warning("cannot remove the spool directory %s", directory)
