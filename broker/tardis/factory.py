"""
:func:`create_composite_pool`: TARDIS's composite pool with the bus between TARDIS and its adapters

Without a ``bus`` section nothing is wrapped (stock TARDIS behaviour). A configuration
error is logged one line per problem and ends the COBalD daemon without tracebacks.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from importlib import import_module
from typing import Any

from cobald.composite.factory import FactoryPool
from cobald.composite.weighted import WeightedComposite
from cobald.decorator.logger import Logger
from cobald.decorator.standardiser import Standardiser
from cobald.interfaces._partial import Partial
from cobald.utility.primitives import infinity
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent
from tardis.configuration.configuration import Configuration
from tardis.resources.poolfactory import create_drone, get_drones_to_restore, load_plugins

from broker.errors import ConfigError
from broker.tardis.batch import RemoteBatchSystemAdapter
from broker.tardis.bus import RemoteBus
from broker.tardis.config import BusConfig, creds_problem, decode_bus, site_problems
from broker.tardis.drone import EventDrone
from broker.tardis.plugin import TardisStateNotes
from broker.tardis.pool import RemoteFactoryPool
from broker.tardis.site import RemoteSiteAdapter

log = logging.getLogger("cobald.runtime.cobald_remote.tardis")


def in_cobald_daemon() -> bool:
    """Whether this process is COBalD's daemon (``python -m cobald.daemon`` or ``cobald``)"""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "cobald.daemon.__main__":
        return True
    return os.path.basename(sys.argv[0]) == "cobald"


def refuse(err: ConfigError) -> ConfigError:
    """
    Log each of ``err``'s problems in one line; in COBalD's daemon, drop the tracebacks

    COBalD reports an exception from loading its configuration three times, each with
    its traceback (``cobald/daemon/runners/base_runner.py:72-74``,
    ``cobald/daemon/runners/meta_runner.py:72-74``, and the ``RuntimeError`` that ends
    the process), and has no exception type it reports without one; ``SystemExit``
    adds a fourth. A configuration error is told in full by its lines, and the daemon
    is about to end, so its tracebacks are suppressed there (``sys.tracebacklimit``).
    """
    for line in err.problems:
        log.error("invalid configuration: %s", line)
    if in_cobald_daemon():
        sys.tracebacklimit = 0
    return err


def bus_config(bus: object, sites: Sequence[str]) -> BusConfig:
    """
    The ``bus`` section, checked with TARDIS's site names; warns of an unreadable creds file

    :raises ConfigError: for every problem, after :func:`refuse`
    """
    config, problems = decode_bus(bus)
    problems += site_problems(sites)
    if config is None or problems:
        raise refuse(ConfigError(problems))
    if config.creds is not None and (why := creds_problem(config.creds)) is not None:
        log.warning("%s", why)
    return config


def load_object(name: str) -> Any:
    """``pkg.mod:Name`` or ``pkg.mod.Name`` as the object it names"""
    module, sep, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not sep or not module or not attr:
        raise ValueError(f"{name!r} is not a dotted name (pkg.module:Name)")
    return getattr(import_module(module), attr)


def load_adapter(kind: str, name: str) -> Any:
    """
    An adapter class: TARDIS's own by name (``HTCondor``) or any by dotted name

    :param kind: ``sites`` or ``batchsystems``
    """
    if ":" in name or "." in name:
        return load_object(name)
    return getattr(import_module(f"tardis.adapters.{kind}.{name.lower()}"), f"{name}Adapter")


def _observers(observers: Mapping[str, Any] | Sequence[str] | None) -> list[Any]:
    if not observers:
        return []
    if isinstance(observers, str):
        observers = [observers]
    items = (
        observers.items()
        if isinstance(observers, Mapping)
        else ((name, None) for name in observers)
    )
    return [load_object(name)(**(kwargs or {})) for name, kwargs in items]


def create_composite_pool(
    configuration: str | dict[str, Any] | None = None,
    interval: float = 30,
    bus: Mapping[str, Any] | None = None,
    observers: Mapping[str, Any] | Sequence[str] | None = None,
) -> Any:
    """
    TARDIS's composite pool, with the bus between TARDIS and its adapters

    Builds what ``tardis.resources.poolfactory.create_composite_pool`` builds
    (reusing its ``create_drone``, ``get_drones_to_restore`` and
    ``load_plugins``), except that

    * each site adapter and the batch-system adapter are wrapped in
      :class:`RemoteSiteAdapter` and :class:`RemoteBatchSystemAdapter`,
      the :class:`TardisStateNotes` plugin is added, each machine type
      gets a :class:`RemoteFactoryPool`, and every drone is an :class:`EventDrone`
      (its state machine runs when its agent's facts change); without
      ``bus`` nothing is wrapped (stock TARDIS behaviour, for comparisons);
    * adapters may be given by dotted name (``pkg.mod:Class``) besides
      TARDIS's own names;
    * the pools adjust every ``interval`` seconds (TARDIS: COBalD's 30 s).

    :param configuration: a TARDIS configuration file or mapping; ``None``
        for the ``tardis:`` section of a unified COBalD configuration
    :param interval: seconds between the pools' adjustments
    :param bus: the ``bus:`` section (:class:`BusConfig`)
    :param observers: more TARDIS plugins, ``{"pkg.mod:Class": {kwargs}}``
        or a list of names (TARDIS itself loads plugins only from ``tardis.plugins``)
    :raises ConfigError: for an invalid ``bus`` section or site name (:func:`bus_config`)
    :raises ValueError: for an invalid adapter name
    """
    config = Configuration(configuration)
    remote = (
        RemoteBus(bus_config(bus, [site.name for site in config.Sites]))
        if bus is not None
        else None
    )
    batch_cls = load_adapter("batchsystems", config.BatchSystem.adapter)
    batch_adapter: Any = batch_cls()
    if remote is not None:
        batch_adapter = RemoteBatchSystemAdapter(batch_adapter, remote)
    batch_system_agent = BatchSystemAgent(batch_system_adapter=batch_adapter)
    plugins = load_plugins()
    plugin_list: list[Any] = [*plugins.values()]  # a real list: Drone.register_plugins appends
    if remote is not None:
        plugin_list.append(TardisStateNotes(remote))
    plugin_list.extend(_observers(observers))

    composites = []
    for site in config.Sites:
        site_cls = load_adapter("sites", site.adapter)
        site_composites = []
        for machine_type in getattr(config, site.name).MachineTypes:
            site_adapter: Any = site_cls(machine_type=machine_type, site_name=site.name)
            if remote is not None:
                site_adapter = RemoteSiteAdapter(site_adapter, remote)
            site_agent = SiteAgent(site_adapter)
            make_drone: Any = (
                create_drone if remote is None else partial(EventDrone, waker=remote.waker)
            )
            restored = [
                make_drone(
                    site_agent=site_agent,
                    batch_system_agent=batch_system_agent,
                    plugins=plugin_list,
                    **resource_attributes,
                )
                for resource_attributes in get_drones_to_restore(plugins, site, machine_type)
            ]
            drone_factory = partial(
                make_drone,
                site_agent=site_agent,
                batch_system_agent=batch_system_agent,
                plugins=plugin_list,
            )
            pool: Any
            if remote is not None:
                pool = RemoteFactoryPool(
                    *restored,
                    factory=drone_factory,
                    interval=interval,
                    bus=remote,
                    site=site_adapter.bus_site,
                    window_s=remote.config.scale_down_window_s,
                    start_s=remote.config.drone_start_s,
                )
            else:
                pool = FactoryPool(*restored, factory=drone_factory, interval=interval)
            site_composites.append(Logger(pool, name=f"{site.name.lower()}_{machine_type.lower()}"))
        composites.append(
            Standardiser(
                WeightedComposite(*site_composites, weight="utilisation"),
                maximum=site.quota if site.quota >= 0 else infinity,
            )
        )
    return WeightedComposite(*composites, weight="utilisation")


# As a YAML tag, COBalD calls ``create_composite_pool.s(**mapping)`` at parse time
# (cobald/daemon/core/config.py); a leaf Partial defers the construction until the
# pipeline is built, after the ``tardis:`` section has filled TARDIS's configuration.
create_composite_pool.s = partial(Partial, create_composite_pool, __leaf__=True)  # type: ignore[attr-defined]
