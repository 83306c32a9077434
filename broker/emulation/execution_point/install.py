"""Putting fake ``condor_*`` executables and an emulator configuration in place"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from broker.emulation.execution_point.paths import CONFIG_FILE
from broker.emulation.execution_point.tools import TOOLS
from remote_agent.deploy_files import DEPLOY_DIR as SHIPPED

#: the drone startd configuration shipped in this repository
DEPLOY_DIR = SHIPPED / "htcondor"
DEPLOY_CONFIG = DEPLOY_DIR / "cobald-remote-drone.conf"


def install_fake_condor(
    bin_dir: Path,
    state_dir: Path,
    *,
    slots: int = 2,
    partitionable: bool = False,
    name: str | None = None,
    host: str = "drone.emulated",
    deploy_config: Path | None = DEPLOY_CONFIG,
    libexec: Path = DEPLOY_DIR,
    extra_config: Sequence[str] | Mapping[str, str] = (),
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """
    Write fake ``condor_master``, ``condor_who``, ``condor_drain`` and
    ``condor_update_machine_ad`` into ``bin_dir`` and an HTCondor configuration
    for an emulated execution point into ``state_dir``

    The configuration defines the machine (``slots`` CPUs; static slots, or one
    partitionable slot), then includes ``deploy_config`` (the drone startd
    configuration under test; ``None``: no hooks, no gate), points its hook
    wrappers at ``libexec``, and ends with ``extra_config`` lines (or knobs),
    which override everything before them.

    :return: an environment for the emulated master and the tools: ``PATH``
        with ``bin_dir`` first, ``CONDOR_CONFIG``, and ``COBALD_REMOTE_PYTHON``
        (the agent exports that in production, see ``remote_agent/gate/paths.py``)
    """
    bin_dir = Path(bin_dir).resolve()
    state_dir = Path(state_dir).resolve()
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    for tool, function in TOOLS.items():
        script = bin_dir / tool
        script.write_text(
            f"#!{python}\n"
            f"# fake {tool} for tests: see broker/emulation/execution_point/tools.py\n"
            "import sys\n"
            f"from broker.emulation.execution_point.tools import {function}\n"
            f"sys.exit({function}(sys.argv))\n"
        )
        script.chmod(0o755)
    lines = [
        "## an emulated HTCondor execution point (install_fake_condor, "
        "broker/emulation/execution_point/install.py)",
        f"EMULATOR_STATE_DIR = {state_dir}",
        "LOCAL_DIR = $(EMULATOR_STATE_DIR)",
        "LOG = $(LOCAL_DIR)/log",
        f"FULL_HOSTNAME = {host}",
        f"NUM_CPUS = {slots}",
        f"SLOT_TYPE_1_PARTITIONABLE = {partitionable}",
        "START = True",
    ]
    if name:
        lines.append(f"STARTD_NAME = {name}")
    if deploy_config is not None:
        lines.append(f"include : {Path(deploy_config).resolve()}")
        lines.append(f"COBALD_REMOTE_LIBEXEC = {Path(libexec).resolve()}")
    # after the include: a drone's master publishes every 60 s, the emulator every second
    lines.append("MASTER_UPDATE_INTERVAL = 1")
    if isinstance(extra_config, Mapping):
        lines.extend(f"{knob} = {value}" for knob, value in extra_config.items())
    else:
        lines.extend(extra_config)
    (state_dir / CONFIG_FILE).write_text("\n".join(lines) + "\n")
    env = dict(os.environ if environ is None else environ)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["CONDOR_CONFIG"] = str(state_dir / CONFIG_FILE)
    env["COBALD_REMOTE_PYTHON"] = python
    return env
