"""
The names other modules import from here; they live in :mod:`broker.jetstream.pull`,
:mod:`broker.jetstream.messages`, :mod:`broker.jetstream.reads` and :mod:`broker.server.durable`
"""

from __future__ import annotations

from broker.jetstream.messages import Disposition, Handler, PullSettings, metadata
from broker.jetstream.pull import PullConsumer
from broker.jetstream.reads import read_all
from broker.server.durable import DEFAULT_DURABLE, durable_config, ensure_consumer

__all__ = [
    "DEFAULT_DURABLE",
    "Disposition",
    "Handler",
    "PullConsumer",
    "PullSettings",
    "durable_config",
    "ensure_consumer",
    "metadata",
    "read_all",
]
