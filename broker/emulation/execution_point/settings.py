"""The knobs the emulated execution point reads from its HTCondor configuration"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from broker.emulation.execution_point.config import Config


@dataclasses.dataclass
class Settings:
    """The knobs the emulator reads from its HTCondor configuration"""

    state_dir: Path
    host: str
    startd_name: str
    cpus: int
    partitionable: bool
    start_expr: str
    retirement_expr: str
    shutdown_graceful_timeout_s: float
    master_update_s: float
    daemon_shutdown: str | None
    startd_start_delay_s: float
    prepare_job: list[str] | None
    job_exit: list[str] | None
    job_exit_timeout_s: float

    @classmethod
    def from_config(cls, config: Config) -> Settings:
        state_dir = Path(config.get("EMULATOR_STATE_DIR") or config.get("LOCAL_DIR") or ".")
        host = config.get("FULL_HOSTNAME") or "emulated.localdomain"
        name = config.get("STARTD_NAME", subsystem="STARTD")
        keyword = config.get("STARTER_JOB_HOOK_KEYWORD")
        prepare = job_exit = None
        if keyword:
            path = config.get(f"{keyword}_HOOK_PREPARE_JOB")
            if path:
                prepare = [
                    path,
                    *shlex.split(config.get(f"{keyword}_HOOK_PREPARE_JOB_ARGS", "") or ""),
                ]
            exit_path = config.get(f"{keyword}_HOOK_JOB_EXIT")
            job_exit = [exit_path] if exit_path else None
        return cls(
            state_dir=state_dir,
            host=host,
            startd_name=f"{name}@{host}" if name else host,
            cpus=max(1, config.get_int("NUM_CPUS", 1)),
            partitionable=config.get_bool("SLOT_TYPE_1_PARTITIONABLE", False),
            start_expr=config.get("START", subsystem="STARTD") or "True",
            retirement_expr=config.get("MAXJOBRETIREMENTTIME", subsystem="STARTD") or "0",
            shutdown_graceful_timeout_s=config.get_float("SHUTDOWN_GRACEFUL_TIMEOUT", 1800.0),
            master_update_s=config.get_float("MASTER_UPDATE_INTERVAL", 300.0),
            daemon_shutdown=config.get("DAEMON_SHUTDOWN", subsystem="MASTER"),
            startd_start_delay_s=config.get_float("EMULATOR_STARTD_START_DELAY", 0.2),
            prepare_job=prepare,
            job_exit=job_exit,
            job_exit_timeout_s=config.get_float(f"{keyword}_HOOK_JOB_EXIT_TIMEOUT", 30.0)
            if keyword
            else 30.0,
        )
