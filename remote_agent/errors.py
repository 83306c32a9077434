"""Errors that ``remote_agent/`` raises on purpose"""

from __future__ import annotations


class AgentError(Exception):
    """Base for everything remote_agent/ raises on purpose"""


class SettingsError(AgentError):
    """The agent's configuration is missing or invalid; the agent cannot start"""


class SpoolError(AgentError):
    """The event spool cannot be used (locked by another agent, unwritable directory)"""


class IllegalTransition(AgentError):
    """A lifecycle transition that the table in ``remote_agent/agent/state.py`` does not allow"""

    def __init__(self, current: str, wanted: str) -> None:
        super().__init__(f"illegal drone state transition {current} -> {wanted}")
        self.current = current
        self.wanted = wanted
