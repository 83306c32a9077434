"""
The TARDIS/COBalD integration's public names, for the entry point and the docs

``!RemoteTardisPoolFactory`` and ``__type__: broker.tardis_adapter.create_composite_pool``
name this module; the code lives in :mod:`broker.tardis` (``docs/tardis.md``). COBalD
imports it for *every* YAML configuration (``cobald/daemon/core/config.py:35-47``), also
where TARDIS is not installed, so it imports nothing until a name is used: the pool
factory then says which install it needs (:class:`~broker.errors.NeedsManager`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from broker.errors import NeedsManager

if TYPE_CHECKING:
    from broker.tardis.batch import RemoteBatchSystemAdapter
    from broker.tardis.bus import RemoteBus
    from broker.tardis.config import BusConfig, site_token
    from broker.tardis.factory import load_adapter
    from broker.tardis.plugin import TardisStateNotes
    from broker.tardis.pool import RemoteFactoryPool
    from broker.tardis.site import TARDIS_EXCEPTIONS, RemoteSiteAdapter

#: each public name and the module of :mod:`broker.tardis` that defines it
_HOMES = {
    "RemoteBatchSystemAdapter": "batch",
    "RemoteBus": "bus",
    "BusConfig": "config",
    "site_token": "config",
    "load_adapter": "factory",
    "TardisStateNotes": "plugin",
    "RemoteFactoryPool": "pool",
    "TARDIS_EXCEPTIONS": "site",
    "RemoteSiteAdapter": "site",
}

__all__ = [
    "TARDIS_EXCEPTIONS",
    "BusConfig",
    "RemoteBatchSystemAdapter",
    "RemoteBus",
    "RemoteFactoryPool",
    "RemoteSiteAdapter",
    "TardisStateNotes",
    "create_composite_pool",
    "load_adapter",
    "site_token",
]


def _load(module: str, what: str) -> Any:
    try:
        return import_module(f"broker.tardis.{module}")
    except ImportError as err:
        needs = NeedsManager.of(err, what)
        if needs is None:
            raise
        raise needs from err


def create_composite_pool(*args: Any, **kwargs: Any) -> Any:
    """TARDIS's composite pool with the bus: :func:`broker.tardis.factory.create_composite_pool`"""
    factory = _load("factory", "!RemoteTardisPoolFactory")
    return factory.create_composite_pool(*args, **kwargs)


def _tag(*args: Any, **kwargs: Any) -> Any:
    """The tag's constructor: the factory's own leaf ``Partial`` (``.s``), made when used"""
    return _load("factory", "!RemoteTardisPoolFactory").create_composite_pool.s(*args, **kwargs)


# COBalD takes a tag's constructor as ``entry.load().s`` (cobald/daemon/core/config.py:41-44)
create_composite_pool.s = _tag  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_load(_HOMES[name], f"broker.tardis_adapter.{name}"), name)
