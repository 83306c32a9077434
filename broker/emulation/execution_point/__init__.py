"""
An emulated HTCondor execution point (master, startd, fake ``condor_*`` tools)

Not product code: nothing in ``remote_agent/`` or the product side of ``broker/`` imports it.
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
