"""What the agent puts in an event or a reply is cut to the limits of the wire schema"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from remote_agent.protocol.events import DrainIntent
from remote_agent.protocol.fields import MAX_COMMAND, MAX_REQUEST_ID, MAX_TEXT


def cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and ``...``"""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded_command(command: Iterable[str]) -> list[str]:
    """The worker command line for an event: at most :data:`MAX_COMMAND` characters"""
    result: list[str] = []
    left = MAX_COMMAND
    for arg in command:
        if len(arg) > left:
            result.append(cut(arg, max(left, 3)) if left >= 3 else "...")
            break
        result.append(arg)
        left -= len(arg)
    return result


def bounded_intent(intent: DrainIntent) -> DrainIntent:
    """``intent`` with its reason and request id cut to the snapshot limits"""
    if len(intent.reason) <= MAX_TEXT and len(intent.request_id) <= MAX_REQUEST_ID:
        return intent
    return msgspec.structs.replace(
        intent,
        reason=cut(intent.reason, MAX_TEXT),
        request_id=cut(intent.request_id, MAX_REQUEST_ID),
    )
