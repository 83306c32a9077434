"""
The real Slurm of the tests (``broker.emulation.site.slurm``), one per test session

Its rule: where the packages are missing the Slurm tests are skipped, with the reason in
the summary (``-rs``), and the rest of the suite runs.
"""

from __future__ import annotations

import pytest

from broker.emulation.site.slurm import missing

#: the mark of every test that needs the real Slurm
requires_slurm = pytest.mark.skipif(missing() is not None, reason=str(missing()))
