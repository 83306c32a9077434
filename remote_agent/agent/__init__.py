"""The drone agent: supervises the worker, publishes its lifecycle, keeps the gate"""

from remote_agent.agent.core import Agent

__all__ = ["Agent"]
