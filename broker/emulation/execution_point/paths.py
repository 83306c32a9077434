"""Where an emulated execution point keeps its files (all under its state directory)"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: file names inside the state directory
CONFIG_FILE = "condor_config"
GROUND_TRUTH_FILE = "ground_truth.jsonl"
MASTER_EXIT_FILE = "master_exit"
#: longest path AF_UNIX accepts on Linux
_MAX_SOCKET_PATH = 107


def control_socket_path(state_dir: Path) -> Path:
    """
    The emulator's control socket: ``STATE_DIR/control.sock``, or a short path in
    ``/tmp`` derived from ``state_dir`` if that would be too long for ``AF_UNIX``
    """
    state_dir = state_dir.resolve()
    path = state_dir / "control.sock"
    if len(bytes(path)) <= _MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(bytes(state_dir)).hexdigest()[:16]
    return Path("/tmp") / f"cobald-emu-{digest}.sock"
