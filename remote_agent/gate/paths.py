"""
Where the gate socket is: the variables the agent exports and a hook reads, the path limit
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

#: environment variable naming the gate socket; exported by the agent to its worker
GATE_ENV: Final = "COBALD_REMOTE_GATE"
#: environment variable naming the Python that runs the hooks (the agent's own)
PYTHON_ENV: Final = "COBALD_REMOTE_PYTHON"
#: longest path ``AF_UNIX`` accepts on Linux (``sun_path`` is 108 bytes with the NUL)
MAX_SOCKET_PATH: Final = 107


def worker_environment(path: Path) -> dict[str, str]:
    """The variables the agent adds to its worker's environment so that hooks find it"""
    return {GATE_ENV: str(path), PYTHON_ENV: sys.executable}


def find_gate_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where the agent's gate socket is, as seen by a hook (:data:`GATE_ENV`); ``None`` if unset"""
    named = environ.get(GATE_ENV, "").strip()
    return Path(named) if named else None
