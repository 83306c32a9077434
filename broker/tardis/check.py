"""
:func:`check_file`: what cobald-remote will do with a COBalD configuration, without starting it

The file is read the way the COBalD daemon reads it (``cobald/daemon/core/config.py``:
its ``COBalDLoader`` with every ``cobald.config.yaml_constructors`` tag, the
``cobald.config.sections`` it accepts), and a split TARDIS file the way TARDIS reads it
(``tardis/configuration/configuration.py:52-53``); the pipeline is not built, so no
adapter, plugin or service is made. Its one rule: every problem is one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml  # PyYAML, as COBalD and TARDIS use it
from cobald.daemon.core.config import COBalDLoader, add_constructor_plugins, load_section_plugins
from cobald.interfaces._partial import Partial

from broker import tardis_adapter
from broker.tardis.config import (
    BusConfig,
    creds_problem,
    decode_bus,
    shown,
    site_problems,
    site_token,
)
from broker.tardis.factory import create_composite_pool, load_adapter

#: the ``__type__`` names of the pool factory (the tag is ``!RemoteTardisPoolFactory``)
FACTORY_NAMES = frozenset(
    {"broker.tardis_adapter.create_composite_pool", "broker.tardis.factory.create_composite_pool"}
)
#: the pool factory as the ``!RemoteTardisPoolFactory`` tag or a caller may hold it
_FACTORIES = (create_composite_pool, tardis_adapter.create_composite_pool)
_YAML_GROUP = "cobald.config.yaml_constructors"
_SECTION_GROUP = "cobald.config.sections"


@dataclass(frozen=True, slots=True)
class Site:
    """One TARDIS site as cobald-remote will see it"""

    name: str
    adapter: str
    quota: str
    machine_types: tuple[str, ...]
    bus_site: str | None  #: the site token of its drones' uuids and subjects


@dataclass(slots=True)
class Factory:
    """One cobald-remote pool factory of the configuration"""

    where: str  #: e.g. ``pipeline[3]``
    form: str  #: ``!RemoteTardisPoolFactory`` or ``__type__: ...``
    interval: object = 30
    tardis_source: str = "the tardis: section"
    batch_system: str | None = None
    sites: list[Site] = field(default_factory=list)
    bus: BusConfig | None = None  #: ``None``: no ``bus`` (stock TARDIS) or not valid
    has_bus: bool = True
    creds: str | None = None  #: why the credentials file cannot be read, if it cannot


@dataclass(slots=True)
class Report:
    """What :func:`check_file` found: the factories, problems (not valid) and warnings"""

    path: Path
    factories: list[Factory] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class _Loader(COBalDLoader):
    """COBalD's loader with the same tags, without touching COBalD's own class"""


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _read_cobald(path: Path) -> Any:
    """The file as the daemon parses it (``cobald/daemon/config/yaml.py:15-24``)"""
    add_constructor_plugins(_YAML_GROUP, _Loader)
    with path.open() as stream:
        loader = _Loader(stream)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()


def _factories(node: object, where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """
    Every pool factory under ``node``: ``(where, form, its keyword arguments)``

    Each object is visited once, without recursion: YAML aliases make shared and
    cyclic structures, which a plain walk would follow without end.
    """
    todo: list[tuple[object, str]] = [(node, where)]
    seen: set[int] = set()
    while todo:
        node, where = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Partial) and node.ctor in _FACTORIES:
            yield where, "!RemoteTardisPoolFactory", dict(node.kwargs)
        elif isinstance(node, Mapping):
            kind = node.get("__type__")
            if isinstance(kind, str) and kind in FACTORY_NAMES:
                kwargs = {k: v for k, v in node.items() if k != "__type__"}
                yield where, f"__type__: {kind}", kwargs
                continue
            items = [
                (value, f"{where}.{key}" if where else str(key)) for key, value in node.items()
            ]
            todo.extend(reversed(items))
        elif isinstance(node, list):
            todo.extend(reversed([(item, f"{where}[{i}]") for i, item in enumerate(node)]))


def _text(value: object) -> str:
    """A value the file should give as text, as it is, or bounded if it is none"""
    return value if isinstance(value, str) else shown(value)


def _tardis_section(configuration: object, data: Mapping[str, Any]) -> tuple[str, object]:
    """Where the factory's TARDIS configuration comes from, and its content"""
    if configuration is None:
        return "the tardis: section", data.get("tardis")
    if isinstance(configuration, str):
        import tardis.configuration.configuration  # noqa: F401 (registers TARDIS's YAML tags)

        source = os.path.abspath(configuration)
        with open(configuration) as stream:  # relative to the daemon's directory, as TARDIS
            return source, yaml.safe_load(stream)
    return "the configuration: mapping", configuration


def _sites(tardis: Mapping[str, Any], problems: list[str]) -> list[Site]:
    sites = []
    names = []
    for entry in tardis.get("Sites") or []:
        if not isinstance(entry, Mapping) or "name" not in entry or "adapter" not in entry:
            problems.append(f"tardis.Sites: {shown(entry)} has no name and adapter")
            continue
        name, adapter = _text(entry["name"]), _text(entry["adapter"])
        names.append(name)
        try:
            load_adapter("sites", adapter)
        except (ImportError, AttributeError, ValueError) as err:
            problems.append(f"tardis.Sites: {name}: cannot load site adapter {adapter!r}: {err}")
        section = tardis.get(name)
        types = section.get("MachineTypes") if isinstance(section, Mapping) else None
        if not types:
            problems.append(f"tardis.{name}.MachineTypes: expected a list of machine types")
        try:
            token: str | None = site_token(name)
        except ValueError:
            token = None
        quota = _text(entry.get("quota", -1))
        sites.append(Site(name, adapter, quota, tuple(map(_text, types or ())), token))
    if not names:
        problems.append("tardis.Sites: expected a list of sites, each with a name and adapter")
    problems += site_problems(names)
    return sites


def _batch_system(tardis: Mapping[str, Any], problems: list[str]) -> str | None:
    batch = tardis.get("BatchSystem")
    adapter = batch.get("adapter") if isinstance(batch, Mapping) else None
    if adapter is None:
        problems.append(
            "tardis.BatchSystem.adapter: expected a batch system adapter, e.g. HTCondor"
        )
        return None
    try:
        load_adapter("batchsystems", _text(adapter))
    except (ImportError, AttributeError, ValueError) as err:
        problems.append(f"tardis.BatchSystem: cannot load adapter {_text(adapter)!r}: {err}")
    return _text(adapter)


def _factory(where: str, form: str, kwargs: dict[str, Any], data: Any, report: Report) -> Factory:
    found = Factory(where, form, interval=kwargs.get("interval", 30))
    problems = report.problems
    interval = found.interval
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not interval > 0:
        found.interval = shown(interval)
        problems.append(f"{where}.interval: expected a number of seconds > 0, got {found.interval}")
    try:
        found.tardis_source, tardis = _tardis_section(kwargs.get("configuration"), data)
    except (OSError, yaml.YAMLError) as err:
        problems.append(f"{where}.configuration: cannot read it: {_one_line(err)}")
        tardis = None
    if isinstance(tardis, Mapping):
        found.batch_system = _batch_system(tardis, problems)
        found.sites = _sites(tardis, problems)
    else:
        problems.append(
            "tardis: expected TARDIS's configuration (a tardis: section or configuration: FILE), "
            f"got {shown(tardis)} from {found.tardis_source}"
        )
    found.has_bus = kwargs.get("bus") is not None
    if found.has_bus:
        found.bus, bus_problems = decode_bus(kwargs["bus"])
        problems += bus_problems
        if found.bus is not None and found.bus.creds is not None:
            found.creds = creds_problem(found.bus.creds)
            if found.creds is not None:
                report.warnings.append(found.creds)
        if found.bus is not None:
            report.warnings += bootstrap_warnings(found.bus)
            report.warnings += slurm_warnings(found.bus, found.sites)
    else:
        report.warnings.append(f"{where}: no bus section: stock TARDIS, nothing is wrapped")
    return found


def bootstrap_warnings(bus: BusConfig) -> list[str]:
    """What keeps the issuer from working here: its key file, the drones' credentials"""
    from broker.errors import AuthError
    from broker.server.auth.authority import load_issuer_key

    if bus.bootstrap_key is None:
        return []
    warnings = []
    try:
        load_issuer_key(Path(bus.bootstrap_key))
    except AuthError as err:
        warnings.append(
            f"bus.bootstrap_key: {err}; the manager cannot issue drone identities "
            "(the file `cobald-remote auth issuer-key` wrote, readable by the user that runs "
            "COBalD)"
        )
    if bus.bootstrap_creds is None:
        warnings.append(
            "bus.bootstrap_creds: not set; each drone must find its site's bootstrap "
            "credentials in $COBALD_REMOTE_BOOTSTRAP_CREDS "
            '(docs: deployment, "Bootstrapped identities")'
        )
    return warnings


def slurm_warnings(bus: BusConfig, sites: Sequence[Site]) -> list[str]:
    """
    Slurm splits ``sbatch --export`` at every comma (docs/deployment.md#a-slurm-site):
    a drone of a Slurm site would get only the first of several ``drone_servers``
    """
    if len(bus.drone_servers) < 2:
        return []
    return [
        f"tardis.Sites: {site.name} is a Slurm site: its drones get only the first of "
        f"bus.drone_servers ({bus.drone_servers[0]}), as Slurm splits sbatch --export at "
        "commas; give the drones one URL (a leaf node at the site), or all of them in the "
        "nodes' /etc/cobald-remote/drone.env as COBALD_REMOTE_URL"
        for site in sites
        if "slurm" in site.adapter.lower()
    ]


def check_file(path: Path) -> Report:
    """
    Read ``path`` as the COBalD daemon would and describe every cobald-remote pool factory

    Nothing raises: each problem becomes one line of :attr:`Report.problems`.
    """
    report = Report(path)
    if path.suffix not in (".yaml", ".yml"):
        report.problems.append(f"{path}: COBalD reads YAML only from a .yaml or .yml file")
        return report
    try:
        data = _read_cobald(path)
    except PermissionError as err:
        report.problems.append(
            f"{path}: not readable by uid {os.getuid()} ({err.strerror}); "
            "let the user that runs COBalD read it"
        )
        return report
    except Exception as err:  # YAML syntax, or a tag's constructor refusing its arguments
        report.problems.append(f"{path}: {_one_line(err)}")
        return report
    if not isinstance(data, Mapping):
        report.problems.append(f"{path}: expected a mapping of sections, got {shown(data)}")
        return report
    sections = {plugin.section for plugin in load_section_plugins(_SECTION_GROUP)}
    unknown = sorted(set(data) - sections - {"logging"})
    if unknown:
        report.problems.append(f"{path}: unknown sections (COBalD refuses them): {unknown}")
    for where, form, kwargs in _factories(data.get("pipeline"), "pipeline"):
        report.factories.append(_factory(where, form, kwargs, data, report))
    if not report.factories:
        report.problems.append(
            f"{path}: no cobald-remote pool factory (!RemoteTardisPoolFactory) in its pipeline"
        )
    return report
