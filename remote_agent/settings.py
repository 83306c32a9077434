"""
The agent's configuration, parsed once at the edge into a frozen dataclass

Every setting comes from a command-line option, else an environment variable,
else a default (see ``docs/agent.md`` for the table). The drone's identity
comes from the environment TARDIS gives each drone job (``TardisDroneUuid``).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal

from remote_agent.batchsystem import BatchJob, parse_slurm_time
from remote_agent.errors import SettingsError
from remote_agent.gate.paths import GATE_ENV, MAX_SOCKET_PATH
from remote_agent.jobruntime import RUNTIME_ENV, RuntimeAttribute, parse_attributes
from remote_agent.protocol.environment import (
    BUS_SETTINGS_ENV,
    NATS_TOOL_ENV,
    TARDIS_CORES_ENV,
    TARDIS_SETTINGS_ENV,
    TARDIS_UUID_ENV,
    TARDIS_WALLTIME_ENV,
    server_url_problem,
    site_of,
    split_urls,
)
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.names import DEFAULT_PREFIX, check_token

DeadlinePolicy = Literal["wait", "kill"]

#: the job ad attributes that give a payload's runtime, first found counts: CMS's
#: ``MaxWallTimeMins`` (CRAB writes the number; WMAgent an expression, and the number as
#: ``OriginalMaxWallTimeMins``), ATLAS's ``maxWallTime`` (Harvester's pilots through an
#: HTCondor-CE), HTCondor's own limits ``AllowedJobDuration`` and ``AllowedExecuteDuration``
DEFAULT_RUNTIME_ATTRIBUTES: Final = parse_attributes(
    "MaxWallTimeMins:min,OriginalMaxWallTimeMins:min,maxWallTime:min,"
    "AllowedJobDuration:s,AllowedExecuteDuration:s"
)


@dataclass(frozen=True, slots=True)
class Settings:
    """
    Everything ``agent run`` needs to know, validated

    :param site: site name (subject token), as the manager knows the site
    :param drone: the drone's TARDIS uuid (subject token)
    :param servers: NATS URLs, tried in turn
    :param worker_command: the supervised command, normally ``condor_master -f``
    :param creds: NATS credentials file for this drone, if the broker wants one
    :param prefix: first subject token of everything cobald-remote publishes
    :param domain: JetStream domain of the central stream and bucket, when the
        drone reaches them through a site's leaf node (``deploy/nats/leaf.conf``)
    :param heartbeat_s: seconds between heartbeats (full snapshots)
    :param poll_s: seconds between ``condor_who`` polls (backstop for the hooks)
    :param spool_dir: directory of the event spool and (by default) the gate socket
    :param spool_max_events: events the spool holds before it drops the oldest
    :param deadline_policy: what to do with payloads still running when a drain's
        deadline passes: ``wait`` for them, or ``kill`` them (``condor_drain -fast``)
    :param slots: slots (cores) the drone offers, the denominator of its
        utilisation; ``condor_who`` lists only busy slots, so this comes from the
        job (``$TardisDroneCores``) and is raised to what the startd shows busy
    :param startd: whether the worker is an HTCondor startd; without one nothing is
        polled and the gate opens right after the handshake claim
    :param gate_socket: Unix socket the job hooks use to reach the agent
    :param end_grace_s: after ``drained``, seconds the worker gets to end by itself
        (the startd exits on drain completion) before the agent terminates it
    :param kill_after_s: seconds between terminating the worker and killing it
    :param self_drain_deadline_s: the deadline, from now, of the drain the agent
        starts by itself when its handshake record is released, deleted or
        rewritten while it is up (the payloads running then may finish until it)
    :param exit_flush_s: at exit, seconds to spend publishing the last events
    :param publish_timeout_s: seconds to wait for one PubAck before retrying
    :param reconnect_wait_s: seconds between reconnect attempts
    :param bootstrap_token: the drone's one-time bootstrap token (from the job's
        environment only, never the command line): the agent makes its own key and
        gets its identity from the manager's issuer (``docs/deployment.md#bootstrap``)
    :param bootstrap_creds: the site's bootstrap credentials, which only reach the issuer
    :param walltime_s: seconds from the agent's start to the end of its batch job, if the
        batch system cannot tell it (``--walltime``, else TARDIS's ``$SLURM_Walltime``)
    :param end_margin_s: seconds before the drone's end by which its payloads must be done
        (or vacated): what the worker needs to end cleanly before the batch system kills it
    :param term_grace_s: seconds from a SIGTERM to the drone's end, if nothing earlier is
        known: Slurm's ``KillWait`` default (30 s) before its SIGKILL, the smaller of it and
        HTCondor's ``MachineMaxVacateTime`` default (600 s)
    :param warning_grace_s: seconds from a SIGUSR1 or SIGUSR2 to the drone's end, if nothing
        earlier is known: the time the site's warning signal gives (``sbatch
        --signal=B:USR1@N``; Slurm's default ``N`` is 60 s)
    :param payload_runtime_s: the runtime assumed for a payload whose job ad gives none
    :param runtime_attributes: the job ad attributes that give a payload's runtime, with
        the seconds per unit of each; the first one the ad carries as a number counts
    :param batch: the drone's batch job as the environment describes it (not an option)
    """

    site: str
    drone: str
    servers: tuple[str, ...]
    worker_command: tuple[str, ...]
    spool_dir: Path
    gate_socket: Path
    creds: Path | None = None
    prefix: str = DEFAULT_PREFIX
    domain: str | None = None
    heartbeat_s: float = 30.0
    poll_s: float = 5.0
    spool_max_events: int = 10_000
    deadline_policy: DeadlinePolicy = "wait"
    startd: bool = True
    slots: int = 0
    end_grace_s: float = 60.0
    kill_after_s: float = 30.0
    self_drain_deadline_s: float = 86_400.0
    exit_flush_s: float = 10.0
    publish_timeout_s: float = 5.0
    reconnect_wait_s: float = 2.0
    bootstrap_token: str | None = field(default=None, repr=False)
    bootstrap_creds: Path | None = None
    walltime_s: float | None = None
    end_margin_s: float = 30.0
    term_grace_s: float = 30.0
    warning_grace_s: float = 60.0
    payload_runtime_s: float = 0.0
    runtime_attributes: tuple[RuntimeAttribute, ...] = DEFAULT_RUNTIME_ATTRIBUTES
    batch: BatchJob = field(default_factory=BatchJob)

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        worker_command: Sequence[str] = (),
        **options: Any,
    ) -> Settings:
        """
        Build the settings from ``options`` (``None`` values are ignored), else ``env``

        :param env: the environment, ``os.environ`` if omitted
        :param options: values by field name, as the command line gives them
        :raises SettingsError: if a value is missing or invalid
        """
        env = os.environ if env is None else env
        given = {k: v for k, v in options.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise SettingsError(f"unknown settings: {', '.join(sorted(unknown))}")

        def pick(name: str, parse: Callable[[str], Any], default: Any = _FIELD_DEFAULT) -> Any:
            if default is _FIELD_DEFAULT:
                default = field_default(name)
            if name in given:
                return given[name]
            raw = env.get(SETTINGS_ENV[name], "").strip()
            if not raw:
                return default
            try:
                return parse(raw)
            except ValueError as err:
                raise SettingsError(f"invalid {SETTINGS_ENV[name]}={raw!r}: {err}") from None

        drone = given.get("drone") or env.get(SETTINGS_ENV["drone"]) or env.get(TARDIS_UUID_ENV)
        if not drone:
            raise SettingsError(
                f"no drone identity: set {TARDIS_UUID_ENV} (TARDIS does) or "
                f"{SETTINGS_ENV['drone']}, or pass --drone"
            )
        site = (
            given.get("site")
            or env.get(SETTINGS_ENV["site"])
            or env.get(TARDIS_SETTINGS_ENV["site"])
            or site_of(drone)
        )
        if not site:
            raise SettingsError(
                f"no site for drone {drone!r} (not a TARDIS uuid <site>-<10 hex>): "
                f"set {SETTINGS_ENV['site']} or pass --site"
            )
        servers = (
            given.get("servers")
            or split_urls(env.get(SETTINGS_ENV["servers"], ""))
            or split_urls(env.get(TARDIS_SETTINGS_ENV["servers"], ""))
            or split_urls(env.get(NATS_TOOL_ENV["servers"], ""))
        )
        if not servers:
            raise SettingsError(
                f"no broker URL: set {SETTINGS_ENV['servers']} (or {NATS_TOOL_ENV['servers']}) "
                "or pass --server"
            )
        if not worker_command:
            raise SettingsError("no worker command: give it after '--'")
        spool_dir = pick("spool_dir", Path) or default_spool_dir(drone, env)
        creds = pick("creds", Path, env.get(NATS_TOOL_ENV["creds"], "").strip() or None)
        if creds is not None and not Path(creds).is_file():
            raise SettingsError(f"credentials file {str(creds)!r} does not exist")
        token = env.get(SETTINGS_ENV["bootstrap_token"], "").strip() or (
            env.get(TARDIS_SETTINGS_ENV["token"], "").strip()
        )
        bootstrap_creds = pick(
            "bootstrap_creds", Path, env.get(TARDIS_SETTINGS_ENV["bootstrap_creds"], "").strip()
        )
        _check_bootstrap(token, bootstrap_creds, creds)
        settings = cls(
            site=site,
            drone=drone,
            servers=tuple(servers),
            worker_command=tuple(worker_command),
            spool_dir=Path(spool_dir),
            gate_socket=Path(
                pick("gate_socket", Path) or default_gate_socket(Path(spool_dir), env)
            ),
            creds=Path(creds) if creds is not None else None,
            prefix=pick(
                "prefix", str, env.get(TARDIS_SETTINGS_ENV["prefix"], "").strip() or DEFAULT_PREFIX
            ),
            domain=pick("domain", str, env.get(TARDIS_SETTINGS_ENV["domain"], "").strip()) or None,
            heartbeat_s=pick("heartbeat_s", float),
            poll_s=pick("poll_s", float),
            spool_max_events=pick("spool_max_events", int),
            deadline_policy=pick("deadline_policy", str),
            startd=pick("startd", _parse_bool),
            slots=pick("slots", int, _cores(env)),
            end_grace_s=pick("end_grace_s", float),
            kill_after_s=pick("kill_after_s", float),
            self_drain_deadline_s=pick("self_drain_deadline_s", float),
            exit_flush_s=pick("exit_flush_s", float),
            publish_timeout_s=pick("publish_timeout_s", float),
            reconnect_wait_s=pick("reconnect_wait_s", float),
            bootstrap_token=token or None,
            bootstrap_creds=Path(bootstrap_creds) if token else None,
            walltime_s=pick("walltime_s", float, _tardis_walltime(env)),
            end_margin_s=pick("end_margin_s", float),
            term_grace_s=pick("term_grace_s", float),
            warning_grace_s=pick("warning_grace_s", float),
            payload_runtime_s=pick("payload_runtime_s", float),
            runtime_attributes=pick("runtime_attributes", parse_attributes),
            batch=BatchJob.from_env(env),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        """:raises SettingsError: if a value is out of range"""
        self._check_tokens()
        self._check_numbers()
        if self.deadline_policy not in ("wait", "kill"):
            raise SettingsError(
                f"deadline policy must be 'wait' or 'kill', not {self.deadline_policy!r}"
            )
        problem = server_url_problem(self.servers)
        if problem is not None:
            raise SettingsError(f"broker URLs: {problem}")
        if len(os.fsencode(self.gate_socket)) > MAX_SOCKET_PATH:
            raise SettingsError(
                f"gate socket path is too long for a Unix socket: {self.gate_socket}"
            )

    def _check_tokens(self) -> None:
        """:raises SettingsError: if a name that goes into subjects is not a subject token"""
        try:
            check_token(self.site, "site")
            check_token(self.drone, "drone uuid")
            check_token(self.prefix, "subject prefix")
            if self.domain is not None:
                check_token(self.domain, "JetStream domain")
        except SchemaError as err:
            raise SettingsError(str(err)) from None

    def _check_numbers(self) -> None:
        """:raises SettingsError: if a time, the slots or the spool's size is out of range"""
        # finite: a heartbeat's interval goes on the wire, where infinity is invalid
        for name in ("heartbeat_s", "poll_s", "publish_timeout_s", "reconnect_wait_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise SettingsError(
                    f"{name} must be a finite positive number, not {getattr(self, name)}"
                )
        if self.walltime_s is not None and not 0 < self.walltime_s < math.inf:
            raise SettingsError(
                f"walltime_s must be a finite positive number, not {self.walltime_s}"
            )
        for name in (
            "end_grace_s",
            "kill_after_s",
            "exit_flush_s",
            "self_drain_deadline_s",
            "end_margin_s",
            "term_grace_s",
            "warning_grace_s",
            "payload_runtime_s",
        ):
            if not 0 <= getattr(self, name) < math.inf:
                raise SettingsError(
                    f"{name} must be a finite number >= 0, not {getattr(self, name)}"
                )
        if self.slots < 0:
            raise SettingsError(f"slots must not be negative, not {self.slots}")
        if self.spool_max_events < 10:
            raise SettingsError(
                f"spool_max_events must be at least 10, not {self.spool_max_events}"
            )


#: the environment variable of each setting
SETTINGS_ENV: Final = {
    "drone": "COBALD_REMOTE_DRONE",
    "site": "COBALD_REMOTE_SITE",
    **BUS_SETTINGS_ENV,
    "heartbeat_s": "COBALD_REMOTE_HEARTBEAT_S",
    "poll_s": "COBALD_REMOTE_POLL_S",
    "spool_dir": "COBALD_REMOTE_SPOOL_DIR",
    "spool_max_events": "COBALD_REMOTE_SPOOL_MAX_EVENTS",
    "deadline_policy": "COBALD_REMOTE_DEADLINE_POLICY",
    "startd": "COBALD_REMOTE_STARTD",
    "slots": "COBALD_REMOTE_SLOTS",
    "gate_socket": GATE_ENV,  # the same variable the hooks read
    "end_grace_s": "COBALD_REMOTE_END_GRACE_S",
    "kill_after_s": "COBALD_REMOTE_KILL_AFTER_S",
    "self_drain_deadline_s": "COBALD_REMOTE_SELF_DRAIN_DEADLINE_S",
    "exit_flush_s": "COBALD_REMOTE_EXIT_FLUSH_S",
    "publish_timeout_s": "COBALD_REMOTE_PUBLISH_TIMEOUT_S",
    "reconnect_wait_s": "COBALD_REMOTE_RECONNECT_WAIT_S",
    "bootstrap_token": "COBALD_REMOTE_TOKEN",
    "bootstrap_creds": "COBALD_REMOTE_BOOTSTRAP_CREDS",
    "walltime_s": "COBALD_REMOTE_WALLTIME_S",
    "end_margin_s": "COBALD_REMOTE_END_MARGIN_S",
    "term_grace_s": "COBALD_REMOTE_TERM_GRACE_S",
    "warning_grace_s": "COBALD_REMOTE_WARNING_GRACE_S",
    "payload_runtime_s": "COBALD_REMOTE_PAYLOAD_RUNTIME_S",
    "runtime_attributes": RUNTIME_ENV,  # the same variable the hooks read
}

#: every setting's default, as the dataclass above declares it (``None``: it has none)
_DEFAULTS: Final = {f.name: None if f.default is MISSING else f.default for f in fields(Settings)}
_FIELD_DEFAULT: Final = object()


def field_default(name: str) -> Any:
    """The default of setting ``name``: the one place the agent's defaults are written"""
    return _DEFAULTS[name]


#: variables whose values only the agent may read: the worker's environment leaves them out
SECRET_ENV: Final = frozenset({SETTINGS_ENV["bootstrap_token"], TARDIS_SETTINGS_ENV["token"]})


def _check_bootstrap(token: str, bootstrap_creds: object, creds: object) -> None:
    """:raises SettingsError: if a bootstrap token comes without its credentials, or with others"""
    if not token:
        return
    if creds is not None:
        raise SettingsError(
            f"both a bootstrap token (${SETTINGS_ENV['bootstrap_token']} or "
            f"${TARDIS_SETTINGS_ENV['token']}) and --creds: give one"
        )
    if not bootstrap_creds:
        raise SettingsError(
            "a bootstrap token but no bootstrap credentials: set "
            f"${SETTINGS_ENV['bootstrap_creds']} or pass --bootstrap-creds (the site's file"
            " from `cobald-remote auth bootstrap`)"
        )
    if not Path(str(bootstrap_creds)).is_file():
        raise SettingsError(f"bootstrap credentials file {str(bootstrap_creds)!r} does not exist")


def _tardis_walltime(env: Mapping[str, str]) -> float | None:
    """
    TARDIS's ``$SLURM_Walltime`` in seconds, else ``None``

    :raises SettingsError: if it is set but no Slurm time limit
    """
    raw = env.get(TARDIS_WALLTIME_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_slurm_time(raw)
    except ValueError as err:
        raise SettingsError(f"invalid {TARDIS_WALLTIME_ENV}={raw!r}: {err}") from None


def _cores(env: Mapping[str, str]) -> int:
    """TARDIS's ``$TardisDroneCores`` (a number, possibly written as a float), else 0"""
    try:
        return max(0, int(float(env.get(TARDIS_CORES_ENV, "0"))))
    except ValueError:
        return 0


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false, yes/no, on/off or 1/0")


def default_spool_dir(drone: str, env: Mapping[str, str]) -> Path:
    """
    ``cobald-remote-<drone>`` in the job's own directory: HTCondor's scratch directory, else
    ``$SLURM_TMPDIR`` (a per-job directory that Slurm sites' prologs make), else
    ``$TMPDIR``, else the system's (per job with Slurm's ``job_container/tmpfs``)
    """
    base = (
        env.get("_CONDOR_SCRATCH_DIR")
        or env.get("SLURM_TMPDIR")
        or env.get("TMPDIR")
        or tempfile.gettempdir()
    )
    return Path(base) / f"cobald-remote-{drone}"


def default_gate_socket(spool_dir: Path, env: Mapping[str, str] = os.environ) -> Path:
    """
    ``gate.sock`` in the spool directory; if that path is too long for a Unix
    socket, ``gate.sock`` in a private directory with a short name:
    ``$XDG_RUNTIME_DIR/cobald-remote-<digest>/`` or
    ``<tempdir>/cobald-remote-<uid>-<digest>/`` (the agent creates it 0700, so
    only its user can reach the socket in it)
    """
    path = spool_dir / "gate.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(os.fsencode(spool_dir)).hexdigest()[:16]
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        candidate = Path(runtime) / f"cobald-remote-{digest}" / "gate.sock"
        if len(os.fsencode(candidate)) <= MAX_SOCKET_PATH:
            return candidate
    return Path(tempfile.gettempdir()) / f"cobald-remote-{os.geteuid()}-{digest}" / "gate.sock"


# --------------------------------------------------------------------------- command line
