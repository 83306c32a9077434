"""The COBalD/TARDIS configuration of one demo run: the shipped ``cobald/demo.yaml`` filled in"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.emulation.demo.demand import DEMAND_RECORD
from broker.emulation.demo.scenario import Scenario
from broker.emulation.site.slurm_site import startup_command, tardis_site
from remote_agent.deploy_files import DEPLOY_DIR

#: the COBalD/TARDIS configuration the demo fills in for each run
CONFIG_TEMPLATE = DEPLOY_DIR / "cobald" / "demo.yaml"
#: the drone job TARDIS's HTCondor site adapter submits (``--tardis-adapters htcondor``)
DEPLOY_JDL = CONFIG_TEMPLATE.with_name("drone.jdl")
#: TARDIS's example ``LinearController`` (``docs/source/index.rst:66-81``)
LOW_UTILISATION = 0.9
HIGH_ALLOCATION = 0.9


def render_config(
    scenario: Scenario,
    root: Path,
    *,
    start: float,
    bus: Mapping[str, Any] | None,
    template: Path = CONFIG_TEMPLATE,
) -> str:
    """``deploy/cobald/demo.yaml`` filled in for one run under ``root``"""
    # the controller's demand is bounded by the site's quota, as at a site; the scripted
    # demand never reaches a quota of three times its most
    quota = scenario.max_drones * scenario.slots * (1 if scenario.demand == "controller" else 3)
    values = {
        "demand": "\n  ".join(demand_elements(scenario, start)),
        "demand_record": str(root / DEMAND_RECORD),
        "pool_interval": repr(scenario.pool_interval_s),
        "bus": json.dumps(dict(bus)) if bus is not None else "null",
        "recorder": str(root / "tardis.jsonl"),
        "quota": str(quota),
        "heartbeat": str(int(scenario.heartbeat_s)),
        **{key: json.dumps(value) for key, value in _adapters(scenario, root).items()},
    }
    return string.Template(template.read_text()).substitute(values)


def demand_elements(scenario: Scenario, start: float) -> list[str]:
    """
    The pipeline's first elements, each a line of YAML: the scripted demand, or COBalD's
    ``LinearController`` and ``Limiter`` with the settings of TARDIS's example configuration
    (TARDIS's ``docs/source/index.rst:66-81``: low utilisation and high allocation 0.9,
    rate 1, the ``Limiter``'s minimum 1; the interval COBalD's default), the interval
    scaled with the demo's time (:class:`Scenario`'s ``controller_interval_s``)

    :param start: epoch seconds when the scripted demand's schedule begins
    """
    if scenario.demand == "scripted":
        scripted = {
            "__type__": "broker.emulation.demo.demand.ScheduledDemand",
            "schedule": scenario.schedule(),
            "start": start,
            "interval": 1,
        }
        return [f"- {json.dumps(scripted)}"]
    controller = {
        "low_utilisation": LOW_UTILISATION,
        "high_allocation": HIGH_ALLOCATION,
        "rate": scenario.controller_rate,
        "interval": scenario.controller_interval_s,
    }
    return [f"- !LinearController {json.dumps(controller)}", '- !Limiter {"minimum": 1}']


def _adapters(scenario: Scenario, root: Path) -> dict[str, Any]:
    """The adapter parts of the ``tardis:`` section for ``scenario.tardis_adapters``"""
    meta = {"drone": {"Cores": scenario.slots, "Memory": 2, "Disk": 4}}
    # TARDIS's own HTCondor batch-system adapter, against the fake collector tools
    htcondor_batch_system = {
        "adapter": "HTCondor",
        "max_age": scenario.batch_max_age_s / 60,  # minutes
        "ratios": {"cpu_ratio": "Real(TotalSlotCpus-Cpus)/TotalSlotCpus"},
    }
    if scenario.tardis_adapters == "htcondor":
        return {
            "batch_system": htcondor_batch_system,
            "site_adapter": "HTCondor",
            "site_section": {
                "MachineTypes": ["drone"],
                "MachineTypeConfiguration": {"drone": {"jdl": str(DEPLOY_JDL)}},
                "MachineMetaData": meta,
                "bulk_delay": 0.1,
            },
        }
    if scenario.tardis_adapters == "slurm":  # the real Slurm of broker/emulation/site/slurm.py
        return {
            "batch_system": htcondor_batch_system,
            "site_adapter": "Slurm",
            "site_section": tardis_site(
                startup_command(root), "drone", scenario.slots, scenario.walltime_min
            ),
        }
    if scenario.tardis_adapters != "emulated":
        raise ValueError(
            f"tardis_adapters must be emulated, htcondor or slurm, not {scenario.tardis_adapters!r}"
        )
    return {
        "batch_system": {
            "adapter": "broker.emulation.site.tardis_adapters:OverlayBatchSystemAdapter",
            "socket": str(root / "obs.sock"),
            "max_age": scenario.batch_max_age_s,  # seconds
        },
        "site_adapter": "broker.emulation.site.tardis_adapters:LocalBatchSiteAdapter",
        "site_section": {
            "socket": str(root / "lbs.sock"),
            "max_age": scenario.site_max_age_s,  # seconds
            "MachineTypes": ["drone"],
            "MachineTypeConfiguration": {"drone": {}},
            "MachineMetaData": meta,
        },
    }


def bus_section(
    scenario: Scenario, url: str, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``bus:`` section of a run with cobald-remote; ``extra``: credentials, the issuer"""
    return {
        "servers": url,
        "lost_after_s": scenario.lost_after_s,
        "drain_deadline_s": 600.0,
        "lost_removal_after_s": 600.0,
        "request_timeout_s": 2.0,
        "scale_down_window_s": scenario.scale_down_window_s,
        "utilisation_hold_s": scenario.utilisation_hold_s,
        **({"drone_start_s": scenario.drone_start_s} if scenario.drones_end else {}),
        **(extra or {}),
    }
