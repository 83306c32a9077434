"""What the manager logs when it ends: a clean end is no lost connection"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from nats.js import JetStreamContext

from broker.manager.service import ManagerService, ManagerSettings
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision


@pytest.mark.parametrize("how", ["stop", "cancel"])
async def test_a_manager_that_ends_does_not_say_it_reconnects(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    await provision(js)
    caplog.set_level(logging.INFO, logger="cobald.runtime.cobald_remote.service")
    service = ManagerService(ManagerSettings(servers=[nats_server.url], retry_s=0.2))
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 30)
    if how == "stop":  # the CLI and tests
        service.stop()
        await asyncio.wait_for(task, 30)
    else:  # COBalD's exit: its event loop cancels the service
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
    messages = [r.getMessage() for r in caplog.records]
    assert "disconnected from NATS: connection closed" in messages
    assert not [m for m in messages if "reconnecting" in m]
