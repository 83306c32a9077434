"""
The ``bus:`` section of the pool factory, decoded once into the frozen :class:`BusConfig`

Its one rule: every problem is one line that names its key and what the key expects,
``bus.<key>: expected <what>, got <value>``, and all of a section's problems are reported
at once (:class:`~broker.errors.ConfigError`).
"""

from __future__ import annotations

import os
import re
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec

from broker.errors import ConfigError
from broker.manager.blackholes import (
    DEFAULT_BLACK_HOLE_BACKOFF_MAX_S,
    DEFAULT_BLACK_HOLE_BACKOFF_S,
    DEFAULT_BLACK_HOLE_DRONES,
    DEFAULT_BLACK_HOLE_LIFETIME_S,
    Rules,
)
from broker.manager.control import DEFAULT_DRAIN_S, DEFAULT_REQUEST_TIMEOUT_S
from broker.manager.issuer import DEFAULT_JWT_VALID_S, DEFAULT_TOKEN_VALID_S, IssuerSettings
from broker.manager.lifecycle import (
    DEFAULT_RETAIN_ENDED_S,
    DEFAULT_RETAIN_LOST_S,
    least_retain_lost_s,
)
from broker.manager.metrics import parse_address
from broker.manager.registry import DEFAULT_LOST_AFTER_S
from broker.manager.service import ManagerSettings
from broker.manager.views import DEFAULT_CLOCK_SKEW_WARN_S
from broker.server.durable import DEFAULT_DURABLE
from broker.tardis.batch import DEFAULT_UTILISATION_HOLD_S
from broker.tardis.pool import DEFAULT_DRONE_START_S, DEFAULT_SCALE_DOWN_WINDOW_S
from remote_agent.protocol.environment import URL_SCHEMES, server_url_problem, split_urls
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.names import DEFAULT_PREFIX, TOKEN_RULE, Namespace, check_token

#: the longest duration a timing key accepts: any finite span a site means (10 years)
LONGEST_S: Final = 10 * 365 * 86_400.0

Seconds = Annotated[float, msgspec.Meta(gt=0, le=LONGEST_S)]
#: seconds, or 0 for "never"
SecondsOrNever = Annotated[float, msgspec.Meta(ge=0, le=LONGEST_S)]
Urls = Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]

#: default seconds of silence after which TARDIS may remove a lost drone whose batch job
#: still runs: a day, so that a drone cut off from the bus keeps its payloads that long
DEFAULT_LOST_REMOVAL_AFTER_S: Final = 86400.0

_SECONDS = "a number of seconds > 0 (at most 10 years)"
_TOKEN = f"{TOKEN_RULE} (no dots, wildcards or whitespace)"
_URLS = (
    f"NATS URLs ({', '.join(f'{s}://' for s in URL_SCHEMES)}HOST:PORT), "
    "a list or one comma-separated string"
)
#: what each key expects, in the words of its error line
EXPECTED: Final[Mapping[str, str]] = {
    "servers": _URLS,
    "drone_servers": _URLS,
    "creds": "the path of the manager's NATS credentials file",
    "domain": f"a JetStream domain ({_TOKEN})",
    "prefix": f"a subject token ({_TOKEN})",
    "durable": f"a consumer name ({_TOKEN})",
    "lost_after_s": _SECONDS,
    "drain_deadline_s": _SECONDS,
    "lost_removal_after_s": _SECONDS,
    "request_timeout_s": _SECONDS,
    "retain_ended_s": _SECONDS,
    "clock_skew_warn_s": _SECONDS,
    "scale_down_window_s": "0 (off) or a number of seconds (at most 10 years)",
    "utilisation_hold_s": "0 (off) or a number of seconds (at most 10 years)",
    "drone_start_s": _SECONDS,
    "retain_lost_s": "0 (never) or a number of seconds at least lost_after_s and "
    "lost_removal_after_s (at most 10 years)",
    "drone_environment": "true or false",
    "note_buffer": "a whole number > 0",
    "metrics": "host:port (e.g. 127.0.0.1:9464), or a port on loopback",
    "bootstrap_key": "the path of the issuer's key file (`cobald-remote auth issuer-key`)",
    "bootstrap_creds": "the path of the site's bootstrap credentials on the drones",
    "bootstrap_token_valid_s": _SECONDS,
    "bootstrap_jwt_valid_s": _SECONDS,
    "black_hole_drones": "a whole number >= 0 (0: off)",
    "black_hole_lifetime_s": _SECONDS,
    "black_hole_backoff_s": _SECONDS,
    "black_hole_backoff_max_s": "a number of seconds at least black_hole_backoff_s "
    "(at most 10 years)",
}


class BusConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """
    The ``bus:`` section of the pool factory, decoded once (:meth:`from_mapping`)

    :param servers: NATS URLs the manager connects to
    :param drone_servers: NATS URLs given to the drones (default ``servers``;
        differs when drones reach the bus through a site's leaf node)
    :param creds: the manager's NATS credentials file
    :param domain: JetStream domain (leaf-node deployments)
    :param prefix: first subject token, as the agents use it
    :param durable: name of the manager's durable consumer
    :param lost_after_s: a drone whose agent was silent this long is *lost*:
        its facts are stale and the wrapped adapters answer again
    :param drain_deadline_s: deadline of the self-drains TARDIS asks for,
        counted from the request
    :param lost_removal_after_s: a lost drone whose batch job still runs is
        removed only after this much silence (and not before its drain deadline)
    :param request_timeout_s: how long commands wait for an agent's answer
    :param retain_ended_s: how long an ended drone is kept before it is retired
    :param retain_lost_s: how long a drone that has not ended (lost, or released before
        its agent spoke) is kept after the newest fact about it before it is retired;
        ``0``: kept until it ends. Not less than ``lost_after_s`` and
        ``lost_removal_after_s``, so that no drone is forgotten before TARDIS may remove it
    :param clock_skew_warn_s: a drone whose clock is off the server's by more is warned
        about (log, metric, ``status``); nothing the manager decides reads a drone's clock
    :param scale_down_window_s: the pools shrink to no less than the highest demand of this
        many seconds before (Kubernetes' scale-down stabilization window); ``0``: to the
        demand now, as COBalD's own pool
    :param utilisation_hold_s: a slot whose payload ended counts as busy in a drone's
        utilisation and allocation for this many seconds, the time the overlay pool takes to
        match a queued payload to it; ``0``: free at once
    :param drone_start_s: how long a new drone is taken to need from TARDIS's request until
        it is supply, until the pool has measured its own drones' starts: a drone whose
        batch job ends within that and a payload's mean runtime no longer counts, and the
        pool grows its replacement
        (:class:`~broker.tardis.pool.StartLatency`)
    :param drone_environment: pass ``servers``/site/prefix into each drone job
    :param note_buffer: TARDIS state notes kept while the bus is unreachable
    :param metrics: ``host:port`` to serve Prometheus metrics on (``/metrics``);
        ``None``: no metrics endpoint
    :param bootstrap_key: the issuer's key file; set, the manager issues every
        drone it submits its own identity (one-time token, then a JWT for the drone's
        own key; ``docs/deployment.md#bootstrap``). ``None``: drones bring credentials
    :param bootstrap_creds: where the site's bootstrap credentials are on the drones
        (``{site}`` is replaced by the site), passed into each drone job
    :param bootstrap_token_valid_s: how long a token waits for its drone to start
    :param bootstrap_jwt_valid_s: how long an issued JWT is valid (the agent renews it)
    :param black_hole_drones: black-hole drones in a row that flag their site, whose pools
        then ask for probe drones only (:mod:`broker.manager.blackholes`); ``0``: off
    :param black_hole_lifetime_s: a drone that ended unasked without a payload within this
        many seconds of its agent's start is a black hole
    :param black_hole_backoff_s: seconds a flagged site waits for its first probe drone
    :param black_hole_backoff_max_s: the longest wait between two probe drones, seconds
    """

    servers: Urls
    drone_servers: tuple[str, ...] = ()
    creds: str | None = None
    domain: str | None = None
    prefix: str = DEFAULT_PREFIX
    durable: str = DEFAULT_DURABLE
    lost_after_s: Seconds = DEFAULT_LOST_AFTER_S
    drain_deadline_s: Seconds = DEFAULT_DRAIN_S
    lost_removal_after_s: Seconds = DEFAULT_LOST_REMOVAL_AFTER_S
    request_timeout_s: Seconds = DEFAULT_REQUEST_TIMEOUT_S
    retain_ended_s: Seconds = DEFAULT_RETAIN_ENDED_S
    retain_lost_s: SecondsOrNever = DEFAULT_RETAIN_LOST_S
    clock_skew_warn_s: Seconds = DEFAULT_CLOCK_SKEW_WARN_S
    scale_down_window_s: SecondsOrNever = DEFAULT_SCALE_DOWN_WINDOW_S
    utilisation_hold_s: SecondsOrNever = DEFAULT_UTILISATION_HOLD_S
    drone_start_s: Seconds = DEFAULT_DRONE_START_S
    drone_environment: bool = True
    note_buffer: Annotated[int, msgspec.Meta(gt=0)] = 10_000
    metrics: str | None = None
    bootstrap_key: str | None = None
    bootstrap_creds: str | None = None
    bootstrap_token_valid_s: Seconds = DEFAULT_TOKEN_VALID_S
    bootstrap_jwt_valid_s: Seconds = DEFAULT_JWT_VALID_S
    black_hole_drones: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_BLACK_HOLE_DRONES
    black_hole_lifetime_s: Seconds = DEFAULT_BLACK_HOLE_LIFETIME_S
    black_hole_backoff_s: Seconds = DEFAULT_BLACK_HOLE_BACKOFF_S
    black_hole_backoff_max_s: Seconds = DEFAULT_BLACK_HOLE_BACKOFF_MAX_S

    def __post_init__(self) -> None:
        if not self.drone_servers:
            msgspec.structs.force_setattr(self, "drone_servers", self.servers)

    @classmethod
    def from_mapping(cls, mapping: object) -> BusConfig:
        """
        :raises ConfigError: listing every problem of the section, one line each
        """
        config, problems = decode_bus(mapping)
        if config is None:
            raise ConfigError(problems)
        return config

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where to serve metrics, ``(host, port)``, or ``None``"""
        return parse_address(self.metrics) if self.metrics is not None else None

    def manager_settings(self) -> ManagerSettings:
        return ManagerSettings(
            servers=self.servers,
            creds=self.creds,
            namespace=Namespace(self.prefix),
            domain=self.domain,
            durable=self.durable,
            lost_after_s=self.lost_after_s,
            request_timeout_s=self.request_timeout_s,
            retain_ended_s=self.retain_ended_s,
            retain_lost_s=self.retain_lost_s,
            clock_skew_warn_s=self.clock_skew_warn_s,
            issuer=self.issuer_settings(),
        )

    def black_hole_rules(self) -> Rules:
        """The black-hole detector's thresholds"""
        return Rules(
            drones=self.black_hole_drones,
            lifetime_s=self.black_hole_lifetime_s,
            backoff_s=self.black_hole_backoff_s,
            backoff_max_s=self.black_hole_backoff_max_s,
        )

    def issuer_settings(self) -> IssuerSettings | None:
        """The issuer's settings if ``bootstrap_key`` is set"""
        if self.bootstrap_key is None:
            return None
        return IssuerSettings(
            key=Path(self.bootstrap_key),
            token_valid_s=self.bootstrap_token_valid_s,
            jwt_valid_s=self.bootstrap_jwt_valid_s,
        )


#: msgspec's ``- at `$.key``` / ``- at `$.key[0]``` suffix, and its key-level messages
_AT_RE = re.compile(r" - at `\$\.(?P<key>\w+)(?P<index>\[\d+\])?`$")
_FIELD_RE = re.compile(r"^Object (?P<what>missing required|contains unknown) field `(?P<key>.+)`$")


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 2, 80, 80, 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4


def shown(value: object) -> str:
    """
    ``value`` as a problem line quotes it: a bounded ``repr``, however large, deep,
    recursive or shared (YAML aliases) what the file built is
    """
    return _SHOWN.repr(value)


def problem(key: str, value: object) -> str:
    """The one line for ``bus.<key>``: what it expects and what it got"""
    return f"bus.{key}: expected {EXPECTED[key]}, got {shown(value)}"


def _explain(err: msgspec.ValidationError, raw: Mapping[str, Any]) -> tuple[str | None, str]:
    """msgspec's error as ``(key, line)``; ``key`` is ``None`` if none is named"""
    text = str(err)
    at = _AT_RE.search(text)
    if at is not None and at["key"] in EXPECTED:
        return at["key"], problem(at["key"], raw.get(at["key"]))
    field = _FIELD_RE.match(text)
    if field is not None and field["what"] == "contains unknown":
        return field["key"], f"bus.{field['key']}: unknown key (known: {', '.join(EXPECTED)})"
    if field is not None:
        return None, f"bus.{field['key']}: required, e.g. nats://nats.example.org:4222"
    if text.startswith("Expected `str` - at `key`"):
        return None, "bus: every key must be a string"
    return None, f"bus: {text}"


def _prepared(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """
    The section as written, with comma-separated URLs split, a bare metrics port as
    text, and a key set to null as if it were not given (its default)
    """
    values = {key: value for key, value in mapping.items() if value is not None}
    for key in ("servers", "drone_servers"):
        if isinstance(values.get(key), str):
            values[key] = split_urls(values[key])
    metrics = values.get("metrics")
    if isinstance(metrics, int) and not isinstance(metrics, bool):
        values["metrics"] = str(metrics)
    return values


def _meanings(config: BusConfig, raw: Mapping[str, Any]) -> list[str]:
    """The checks that are rules of their own (URLs, tokens, the metrics address)"""
    problems = []
    for key in ("servers", "drone_servers"):
        urls = getattr(config, key)
        if key in raw and (why := server_url_problem(urls)) is not None:
            problems.append(problem(key, raw[key]) + (f" ({why})" if len(urls) > 1 else ""))
    for key in ("prefix", "durable", "domain"):
        value = getattr(config, key)
        try:
            if value is not None:
                check_token(value, key)
        except SchemaError:
            problems.append(problem(key, value))
    try:
        _ = config.metrics_address
    except ValueError as err:
        problems.append(f"{problem('metrics', raw.get('metrics'))} ({err})")
    shortest = least_retain_lost_s(config.lost_after_s, config.lost_removal_after_s)
    if 0 < config.retain_lost_s < shortest:
        given = raw.get("retain_lost_s", config.retain_lost_s)
        problems.append(f"{problem('retain_lost_s', given)} ({shortest:.0f} s here)")
    if config.black_hole_backoff_max_s < config.black_hole_backoff_s:
        given = raw.get("black_hole_backoff_max_s", config.black_hole_backoff_max_s)
        problems.append(
            f"{problem('black_hole_backoff_max_s', given)} ({config.black_hole_backoff_s:g} s here)"
        )
    if config.bootstrap_creds is not None and config.bootstrap_key is None:
        problems.append(
            "bus.bootstrap_creds: set without bus.bootstrap_key, which turns the "
            "issuer on: without it no drone gets a token to bootstrap with"
        )
    return problems


def decode_bus(mapping: object) -> tuple[BusConfig | None, list[str]]:
    """
    The section as :class:`BusConfig`, or ``None`` and every problem (one line each)

    msgspec stops at the first problem; a key found wrong is set aside and the
    rest decoded again, so one pass names them all.
    """
    if not isinstance(mapping, Mapping):
        return None, [f"bus: expected a mapping with at least 'servers', got {shown(mapping)}"]
    candidate = _prepared(mapping)
    problems: list[str] = []
    for _ in range(len(mapping) + 2):
        try:
            config = msgspec.convert(candidate, BusConfig, strict=True)
        except msgspec.ValidationError as err:
            key, line = _explain(err, mapping)
            problems.append(line)
            if key is None and ("servers" in candidate or line.startswith("bus: ")):
                return None, problems  # nothing to set aside: stop here
            if key == "servers" or key is None:  # wrong or missing: stand in, find the rest
                candidate["servers"] = ["nats://placeholder"]
            else:
                del candidate[key]
        else:
            problems += _meanings(config, mapping)
            return (config if not problems else None), problems
    return None, problems


def site_token(site_name: str) -> str:
    """
    The site as drones and subjects name it: TARDIS's site name in lower case

    That is the part of every drone uuid before its last ``-``, so the agent,
    the operator commands and the adapters agree without configuration.

    :raises ValueError: if it cannot be a subject token
    """
    try:
        return check_token(site_name.lower(), f"site name {site_name!r}")
    except SchemaError as err:
        raise ValueError(str(err)) from None


def site_problems(names: Sequence[object]) -> list[str]:
    """One line for each TARDIS site name that cannot name the site on the bus"""
    problems = []
    for name in names:
        try:
            site_token(str(name))
        except ValueError:
            problems.append(
                f"tardis.Sites: site name {shown(name)} in lower case is not a subject token "
                f"({_TOKEN}): drone uuids and subjects are made of it"
            )
    return problems


def creds_problem(path: str) -> str | None:
    """
    What keeps this process from reading the credentials file ``path``, and what to do;
    ``None`` if it can read it
    """
    try:
        with open(path, "rb"):
            return None
    except FileNotFoundError:
        return (
            f"bus.creds: {path} does not exist; write it with "
            f"`cobald-remote auth manager --authority FILE --out {path}`"
        )
    except PermissionError:
        return (
            f"bus.creds: {path} is not readable by uid {os.getuid()}; let the user that "
            "runs COBalD read it (chown that user, mode 0600)"
        )
    except OSError as err:
        return f"bus.creds: cannot read {path}: {err.strerror or err}"
