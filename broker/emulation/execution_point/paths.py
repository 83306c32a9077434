"""Where an emulated execution point keeps its files (all under its state directory)"""

from __future__ import annotations

from pathlib import Path

from remote_agent.settings import default_gate_socket

#: file names inside the state directory
CONFIG_FILE = "condor_config"
GROUND_TRUTH_FILE = "ground_truth.jsonl"
MASTER_EXIT_FILE = "master_exit"


def control_socket_path(state_dir: Path) -> Path:
    """
    The emulator's control socket: ``STATE_DIR/control/gate.sock``, or a short
    path if that is too long for ``AF_UNIX``, by the agent's own rule for its
    gate socket (:func:`remote_agent.settings.default_gate_socket`, without
    ``$XDG_RUNTIME_DIR`` so that every process finds the same path); whoever
    binds it creates its directory
    """
    return default_gate_socket(state_dir.resolve() / "control", env={})
