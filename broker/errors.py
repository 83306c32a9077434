"""Errors that ``broker/`` raises on purpose"""

from __future__ import annotations


class BrokerError(Exception):
    """Base for everything broker/ raises on purpose"""


class ServerStartError(BrokerError):
    """The embedded ``nats-server`` could not be started"""


class ProvisioningError(BrokerError):
    """A stream or bucket could not be created or brought up to date"""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"cannot provision {name!r}: {problem}")
        self.name = name
        self.problem = problem
