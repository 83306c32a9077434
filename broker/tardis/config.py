"""The ``bus:`` section of the pool factory, parsed once into :class:`BusConfig`"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from broker.manager.control import DEFAULT_DRAIN_S, DEFAULT_REQUEST_TIMEOUT_S
from broker.manager.metrics import parse_address
from broker.manager.registry import DEFAULT_LOST_AFTER_S
from broker.manager.service import ManagerSettings
from broker.server.durable import DEFAULT_DURABLE
from remote_agent.protocol.environment import split_urls
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.names import DEFAULT_PREFIX, Namespace, check_token


def _servers(value: object, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        items = split_urls(value)
    elif isinstance(value, Sequence):
        items = [str(part).strip() for part in value]
    else:
        raise ValueError(f"bus.{key} must be a URL, a comma-separated string or a list")
    urls = tuple(item for item in items if item)
    if not urls:
        raise ValueError(f"bus.{key} names no URL")
    return urls


@dataclass(frozen=True, slots=True)
class BusConfig:
    """
    The ``bus:`` section of the pool factory, parsed once

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
    :param drone_environment: pass ``servers``/site/prefix into each drone job
    :param note_buffer: TARDIS state notes kept while the bus is unreachable
    :param metrics: ``host:port`` to serve Prometheus metrics on (``/metrics``);
        ``None``: no metrics endpoint
    """

    servers: tuple[str, ...]
    drone_servers: tuple[str, ...] = ()
    creds: str | None = None
    domain: str | None = None
    prefix: str = DEFAULT_PREFIX
    durable: str = DEFAULT_DURABLE
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    drain_deadline_s: float = DEFAULT_DRAIN_S
    lost_removal_after_s: float = DEFAULT_DRAIN_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    drone_environment: bool = True
    note_buffer: int = 10_000
    metrics: str | None = None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> BusConfig:
        """
        :raises ValueError: for unknown keys, missing servers or bad values
        """
        if not isinstance(mapping, Mapping):
            raise ValueError("bus must be a mapping with at least 'servers'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"unknown bus settings: {', '.join(unknown)} (known: {sorted(known)})")
        if "servers" not in mapping:
            raise ValueError("bus.servers is required, e.g. nats://nats.example.org:4222")
        values = dict(mapping)
        values["servers"] = _servers(values["servers"], "servers")
        if values.get("drone_servers"):
            values["drone_servers"] = _servers(values["drone_servers"], "drone_servers")
        else:
            values["drone_servers"] = values["servers"]
        for name in (
            "lost_after_s",
            "drain_deadline_s",
            "lost_removal_after_s",
            "request_timeout_s",
        ):
            if name in values:
                number = float(values[name])
                if not (number > 0 and math.isfinite(number)):
                    raise ValueError(f"bus.{name} must be a positive number of seconds")
                values[name] = number
        try:
            check_token(str(values.get("prefix", DEFAULT_PREFIX)), "bus.prefix")
        except SchemaError as err:
            raise ValueError(str(err)) from None
        if values.get("metrics") is not None:
            values["metrics"] = str(values["metrics"])
            parse_address(values["metrics"])  # raises ValueError with the reason
        return cls(**values)

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
        )


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
