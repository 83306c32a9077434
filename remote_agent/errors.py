"""
Errors that the drone side raises on purpose

::

    AgentError
    ├── SettingsError      the agent's configuration is missing or invalid
    ├── SpoolError         the event spool cannot be used
    ├── IdentityError      the drone's own key cannot be made or read
    ├── IllegalTransition  a lifecycle transition the state table forbids
    ├── GateError          the gate socket cannot be served
    ├── GateUnavailable    a hook got no answer from the agent
    ├── StartdError        the local startd cannot be asked or did not obey
    └── DeployFileError    a shipped deployment file cannot be found or copied

The protocol's own errors are in :mod:`remote_agent.protocol.errors`.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base for everything the drone side raises on purpose"""


class SettingsError(AgentError):
    """The agent's configuration is missing or invalid; the agent cannot start"""


class SpoolError(AgentError):
    """The event spool cannot be used (locked by another agent, unwritable directory)"""


class IdentityError(AgentError):
    """The drone's own key cannot be made or read (its file in the spool directory)"""


class IllegalTransition(AgentError):
    """A lifecycle transition that the table in ``remote_agent/agent/state.py`` does not allow"""

    def __init__(self, current: str, wanted: str) -> None:
        super().__init__(f"illegal drone state transition {current} -> {wanted}")
        self.current = current
        self.wanted = wanted


class GateError(AgentError):
    """The gate socket could not be served"""


class GateUnavailable(AgentError):
    """The hook could not get an answer from the agent (no socket, timeout, bad reply)"""


class StartdError(AgentError):
    """The local startd could not be asked or did not do what was asked"""


class DeployFileError(AgentError):
    """A shipped deployment file cannot be found or copied"""
