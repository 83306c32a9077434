"""Processes and ports of the tests: whether a PID lives, free loopback ports"""

from __future__ import annotations

import contextlib
import os
import socket


def pid_exists(pid: int) -> bool:
    """Whether a process with ``pid`` is still around (tests check we stopped ours)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_ports(count: int) -> list[int]:
    """Loopback ports for listeners whose port must be known before a server starts"""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
