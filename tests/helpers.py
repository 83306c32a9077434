"""Small helpers for the tests (importable: tests/ is on sys.path)"""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """Whether a process with ``pid`` is still around (tests check we stopped ours)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
