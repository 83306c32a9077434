"""
The deployment files that ship inside the package (``remote_agent/deploy/``)

One rule: code and tests find them through :data:`DEPLOY_DIR`, never through
the checkout's layout, so a wheel install has the same files as a clone.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Final

#: the deployment files: one directory per group (``htcondor``, ``nats``, ...)
DEPLOY_DIR: Final = Path(str(files("remote_agent").joinpath("deploy")))
