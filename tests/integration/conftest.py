"""Fixtures of the integration tests (a real nats-server; see tests/conftest.py)"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_garbage_at_teardown() -> Iterator[None]:
    """
    Free what the test left behind before the next test starts

    A socket or transport that a test leaves open is freed by the garbage
    collector with a ResourceWarning, which ``filterwarnings = error`` turns
    into a failure of whichever test runs at that moment. Collecting here
    makes it fail the test that left it (about 75 ms per test).
    """
    yield
    gc.collect()
