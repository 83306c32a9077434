"""What every job of the agent shares: its settings, names, status, emitter, tasks, counters"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from remote_agent.agent.emission import Emitter
from remote_agent.agent.status import DroneStatus
from remote_agent.agent.tasks import Tasks
from remote_agent.protocol.names import Namespace
from remote_agent.settings import Settings


@dataclass(frozen=True)
class AgentContext:
    """The context of one agent, built once by the agent and handed to each of its jobs"""

    settings: Settings
    namespace: Namespace
    #: this run of the agent; a restarted agent has another one
    incarnation: str
    #: the drone's lifecycle, gate, flags and payloads
    status: DroneStatus
    #: things counted for operators: refused payloads, bad commands, ...
    counters: Counter[str]
    emitter: Emitter
    tasks: Tasks
    site: str = field(init=False)
    drone: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "site", self.settings.site)
        object.__setattr__(self, "drone", self.settings.drone)

    @property
    def extra(self) -> dict[str, object]:
        """The context of the agent's log records (a new dict each time)"""
        return {"drone": self.settings.drone}
