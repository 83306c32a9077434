"""
The TARDIS/COBalD integration's public names, for the entry point and the docs

``!RemoteTardisPoolFactory`` and ``__type__: broker.tardis_adapter.create_composite_pool``
name this module; the code lives in :mod:`broker.tardis` (``docs/tardis.md``). COBalD
imports it for *every* YAML configuration, so importing it must stay cheap and free of
side effects.
"""

from broker.tardis.batch import RemoteBatchSystemAdapter
from broker.tardis.bus import RemoteBus
from broker.tardis.config import BusConfig, site_token
from broker.tardis.factory import create_composite_pool, load_adapter
from broker.tardis.notes import TardisStateNotes
from broker.tardis.pool import RemoteFactoryPool
from broker.tardis.site import TARDIS_EXCEPTIONS, RemoteSiteAdapter

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
