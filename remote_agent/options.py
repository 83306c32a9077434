"""
The command line of ``agent run``: one option per setting, each defaulting to its variable

Parsing stays in :mod:`remote_agent.settings`; this only maps the options onto it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remote_agent.jobruntime import RuntimeAttribute, format_attributes, parse_attributes
from remote_agent.protocol.environment import (
    NATS_TOOL_ENV,
    TARDIS_CORES_ENV,
    TARDIS_SETTINGS_ENV,
    TARDIS_UUID_ENV,
    TARDIS_WALLTIME_ENV,
    split_urls,
)
from remote_agent.protocol.names import DEFAULT_PREFIX
from remote_agent.settings import SETTINGS_ENV, Settings, field_default


def _default(setting: str) -> str:
    """A setting's default as the help shows it (the settings hold it, not the help)"""
    value = field_default(setting)
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def _attributes(text: str) -> tuple[RuntimeAttribute, ...]:
    try:
        return parse_attributes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``agent run``; each defaults to its environment variable"""

    def add(flag: str, setting: str, help: str, **kwargs: Any) -> None:
        parser.add_argument(flag, dest=setting, help=f"{help} [${SETTINGS_ENV[setting]}]", **kwargs)

    add("--drone", "drone", f"drone uuid (default ${TARDIS_UUID_ENV})")
    add("--site", "site", "site name (default: the TARDIS uuid without its last '-' part)")
    parser.add_argument(
        "--server",
        "--url",
        dest="servers",
        action="append",
        help="NATS URL; repeat for a cluster (--url: the same) "
        f"[${SETTINGS_ENV['servers']}, else ${TARDIS_SETTINGS_ENV['servers']}, else "
        f"${NATS_TOOL_ENV['servers']}; comma-separated]",
    )
    parser.add_argument(
        "--creds",
        dest="creds",
        type=Path,
        help=f"NATS credentials file [${SETTINGS_ENV['creds']}, else ${NATS_TOOL_ENV['creds']}]",
    )
    add(
        "--bootstrap-creds",
        "bootstrap_creds",
        "the site's bootstrap credentials, used with the job's token "
        f"(${SETTINGS_ENV['bootstrap_token']})",
        type=Path,
    )
    add("--prefix", "prefix", f"first subject token (default {DEFAULT_PREFIX})")
    add("--domain", "domain", "JetStream domain of the central stream and bucket (leaf nodes)")
    add(
        "--heartbeat",
        "heartbeat_s",
        f"seconds between heartbeats (default {_default('heartbeat_s')})",
        type=float,
    )
    add(
        "--poll",
        "poll_s",
        f"seconds between condor_who polls (default {_default('poll_s')})",
        type=float,
    )
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
        f"spool capacity in events (default {_default('spool_max_events')})",
        type=int,
    )
    add(
        "--deadline-policy",
        "deadline_policy",
        "when a drain deadline passes with payloads: wait, or kill them "
        f"(default {_default('deadline_policy')})",
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
        f"seconds the worker gets to end after drained (default {_default('end_grace_s')})",
        type=float,
    )
    add(
        "--kill-after",
        "kill_after_s",
        f"seconds from SIGTERM to SIGKILL of the worker (default {_default('kill_after_s')})",
        type=float,
    )
    add(
        "--self-drain-deadline",
        "self_drain_deadline_s",
        "seconds a self-started drain (record lost while up) lets payloads run "
        f"(default {_default('self_drain_deadline_s')})",
        type=float,
    )
    add(
        "--exit-flush",
        "exit_flush_s",
        f"seconds to publish the last events at exit (default {_default('exit_flush_s')})",
        type=float,
    )
    add(
        "--walltime",
        "walltime_s",
        "seconds from the start to the end of the drone's batch job, where the batch system "
        f"does not say it (default ${TARDIS_WALLTIME_ENV}, minutes)",
        type=float,
    )
    add(
        "--end-margin",
        "end_margin_s",
        "seconds before the drone's end by which its payloads are done or vacated "
        f"(default {_default('end_margin_s')})",
        type=float,
    )
    add(
        "--term-grace",
        "term_grace_s",
        f"seconds from SIGTERM to the drone's end (default {_default('term_grace_s')})",
        type=float,
    )
    add(
        "--warning-grace",
        "warning_grace_s",
        "seconds from SIGUSR1 or SIGUSR2 to the drone's end "
        f"(default {_default('warning_grace_s')})",
        type=float,
    )
    add(
        "--payload-runtime",
        "payload_runtime_s",
        "seconds a payload is taken to run when its job ad gives no runtime "
        f"(default {_default('payload_runtime_s')})",
        type=float,
    )
    add(
        "--runtime-attributes",
        "runtime_attributes",
        "job ad attributes that give a payload's runtime, NAME:UNIT (s, min, h), first found "
        f"counts (default {format_attributes(field_default('runtime_attributes'))})",
        type=_attributes,
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
