"""
The command line of ``agent run``: one option per setting, each defaulting to its variable

Parsing stays in :mod:`remote_agent.settings`; this only maps the options onto it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remote_agent.protocol.environment import TARDIS_CORES_ENV, TARDIS_UUID_ENV, split_urls
from remote_agent.protocol.names import DEFAULT_PREFIX
from remote_agent.settings import SETTINGS_ENV, Settings


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``agent run``; each defaults to its environment variable"""

    def add(flag: str, setting: str, help: str, **kwargs: Any) -> None:
        parser.add_argument(flag, dest=setting, help=f"{help} [${SETTINGS_ENV[setting]}]", **kwargs)

    add("--drone", "drone", f"drone uuid (default ${TARDIS_UUID_ENV})")
    add("--site", "site", "site name (default: the TARDIS uuid without its last '-' part)")
    parser.add_argument(
        "--url",
        dest="servers",
        action="append",
        help=f"NATS URL; repeat for a cluster [${SETTINGS_ENV['servers']}, comma-separated]",
    )
    add("--creds", "creds", "NATS credentials file", type=Path)
    add(
        "--bootstrap-creds",
        "bootstrap_creds",
        "the site's bootstrap credentials, used with the job's token "
        f"(${SETTINGS_ENV['bootstrap_token']})",
        type=Path,
    )
    add("--prefix", "prefix", f"first subject token (default {DEFAULT_PREFIX})")
    add("--domain", "domain", "JetStream domain of the central stream and bucket (leaf nodes)")
    add("--heartbeat", "heartbeat_s", "seconds between heartbeats (default 30)", type=float)
    add("--poll", "poll_s", "seconds between condor_who polls (default 5)", type=float)
    add("--slots", "slots", f"slots (cores) of the drone (default ${TARDIS_CORES_ENV})", type=int)
    add(
        "--spool-dir",
        "spool_dir",
        "event spool (default $_CONDOR_SCRATCH_DIR/cobald-remote-DRONE)",
        type=Path,
    )
    add(
        "--spool-max-events",
        "spool_max_events",
        "spool capacity in events (default 10000)",
        type=int,
    )
    add(
        "--deadline-policy",
        "deadline_policy",
        "when a drain deadline passes with payloads: wait, or kill them (default wait)",
        choices=["wait", "kill"],
    )
    add(
        "--gate-socket",
        "gate_socket",
        "Unix socket for the job hooks (default SPOOL_DIR/gate.sock)",
        type=Path,
    )
    add(
        "--end-grace",
        "end_grace_s",
        "seconds the worker gets to end after drained (default 60)",
        type=float,
    )
    add(
        "--kill-after",
        "kill_after_s",
        "seconds from SIGTERM to SIGKILL of the worker (default 30)",
        type=float,
    )
    add(
        "--self-drain-deadline",
        "self_drain_deadline_s",
        "seconds a self-started drain (record lost while up) lets payloads run (default 86400)",
        type=float,
    )
    add(
        "--exit-flush",
        "exit_flush_s",
        "seconds to publish the last events at exit (default 10)",
        type=float,
    )
    parser.add_argument(
        "--no-startd",
        dest="startd",
        action="store_const",
        const=False,
        help="the worker is not an HTCondor startd: poll nothing, open the gate after the claim "
        f"[${SETTINGS_ENV['startd']}=false]",
    )


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """
    The settings of ``agent run`` from parsed options and the environment

    :raises SettingsError: if a value is missing or invalid
    """
    command = list(args.worker or [])
    if command[:1] == ["--"]:
        command = command[1:]
    options = {name: getattr(args, name, None) for name in SETTINGS_ENV}
    if options["servers"]:
        options["servers"] = [u for arg in options["servers"] for u in split_urls(arg)]
    return Settings.from_env(env, worker_command=command, **options)
