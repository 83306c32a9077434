"""
Errors that ``broker/`` raises on purpose

Every exception class of ``broker/``; the commands print a ``BrokerError`` in one
line and exit 1 (``broker/commands/failures.py``). The tree::

    BrokerError
    ├── ServerStartError        the embedded nats-server did not start
    ├── ProvisioningError       a stream or bucket could not be provisioned
    ├── ConsumerError           a consumer could not be created, or differs
    ├── ConsumerGone            a consumer was deleted on the server
    ├── ConnectError            a command could not reach the broker
    ├── AuthError               keys or credentials cannot be made or read
    ├── Rejected                a message that is not valid (counted, never applied)
    ├── TimelineError           a drone's timeline cannot be read
    ├── OperatorError           an operator command cannot be carried out
    ├── ConfigError             the ``bus:`` section (or the pool factory's) is not valid
    ├── NeedsManager            a module that only ``cobald-remote[manager]`` installs is missing
    └── CliError                any other failure of a command

The emulators' exceptions are in ``broker/emulation/errors.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from broker.manager.validity import Rejection


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


class ConsumerError(BrokerError):
    """A consumer could not be created, or exists with another configuration"""


class ConsumerGone(BrokerError):
    """The consumer was deleted on the server (or lost with a restart)"""


class ConnectError(BrokerError):
    """The broker could not be reached"""


class AuthError(BrokerError):
    """Keys or credentials cannot be made or read"""


class Rejected(BrokerError):
    """A message that is not valid; nothing of it may change any state"""

    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TimelineError(BrokerError):
    """The timeline cannot be read (printed in one line, exit 1)"""


class OperatorError(BrokerError):
    """An operator command that cannot be carried out (printed in one line, exit 1)"""


class ConfigError(BrokerError, ValueError):
    """
    A configuration that is not valid: one line per problem, each naming its key

    :param problems: ``bus.<key>: expected <what>, got <value>``, one per problem
    """

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


class CliError(BrokerError):
    """A failure to report in one line and exit 1"""


#: the top-level modules that only the ``manager`` extra brings (``yaml``: with cobald)
MANAGER_MODULES: Final = frozenset({"cobald", "tardis", "prometheus_client", "yaml"})


class NeedsManager(BrokerError, ImportError):
    """
    ``what`` needs a module of the ``manager`` extra, which this install lacks

    :param what: the command or entry point that needs it
    :param module: the missing top-level module
    """

    def __init__(self, what: str, module: str) -> None:
        super().__init__(
            f"{what} needs the manager install: pip install 'cobald-remote[manager]'"
            f" (no module {module!r} here)"
        )
        self.what = what
        self.module = module

    @classmethod
    def of(cls, err: ImportError, what: str) -> NeedsManager | None:
        """``err`` as the install it calls for, or ``None`` for any other missing module"""
        module = (err.name or "").partition(".")[0]
        return cls(what, module) if module in MANAGER_MODULES else None
