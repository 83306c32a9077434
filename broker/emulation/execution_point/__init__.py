"""
An emulated HTCondor execution point, for the tests and the demo

Not product code: nothing in ``remote_agent/`` or the product side of ``broker/`` imports it.

* :func:`install_fake_condor` writes fake ``condor_master``, ``condor_who``,
  ``condor_drain`` and ``condor_update_machine_ad`` executables and an HTCondor
  configuration that includes ``deploy/htcondor/`` (``install.py``);
* the fake ``condor_master -f`` runs an emulated master and startd that runs
  the configured job hooks like a starter (``startd.py``);
* :class:`EmulatorControl` offers payloads to it and reads its ground truth
  (``control.py``, ``..groundtruth``).

Typical test::

    env = install_fake_condor(tmp_path / "bin", tmp_path / "ep", slots=2)
    async with EmulatedMaster(env) as ep:          # condor_master -f, stopped by PID at the end
        reply = await ep.offer("12.0", duration_s=5)   # {"ok": True, "outcome": "started", ...}
        await ep.wait_for("payload_finished", job_id="12.0")

The agent under test normally starts ``condor_master -f`` itself (as its
worker, with the environment from ``install_fake_condor``); then drive it with
``EmulatorControl(state_dir)``.
"""

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.execution_point.control import EmulatorControl
from broker.emulation.execution_point.install import DEPLOY_CONFIG, DEPLOY_DIR, install_fake_condor
from broker.emulation.execution_point.process import EmulatedMaster
from broker.emulation.groundtruth import read_ground_truth

__all__ = [
    "DEPLOY_CONFIG",
    "DEPLOY_DIR",
    "EmulatedMaster",
    "EmulatorControl",
    "EmulatorUnavailable",
    "install_fake_condor",
    "read_ground_truth",
]
