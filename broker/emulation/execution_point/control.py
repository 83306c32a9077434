"""Driving an emulated execution point: a client of its control socket (the emulators' RPC)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.emulation import rpc
from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE, control_socket_path
from broker.emulation.groundtruth import read_ground_truth


class EmulatorControl:
    """
    Asynchronous client of one emulated execution point, for tests and the demo

    The emulated master listens on
    :func:`~broker.emulation.execution_point.paths.control_socket_path` of its state
    directory. Operations (``op``), each answered with ``ok`` and:

    * ``offer`` (``job_id`` such as "12.0", ``duration_s``, ``exit_code`` 0, ``owner``,
      ``attributes``: more of its job ad, e.g. ``{"MaxWallTimeMins": 60}``):
      ``outcome`` ``started``, ``idle``, ``held``, ``rejected`` (``reason``) or ``vacated``;
      ``slot``. Answered once the PREPARE_JOB hook has decided; the payload then runs on;
    * ``status``: slots, drain, gate extras;
    * ``restart_startd``: only when no job runs;
    * ``shutdown`` (``fast``, a bool): like SIGTERM / SIGQUIT;
    * ``ready_ad``, ``slot_ads``, ``locate``, ``drain``, ``cancel_drain``,
      ``update_machine_ad``: for the fake ``condor_who``, ``condor_drain`` and
      ``condor_update_machine_ad``.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.socket = control_socket_path(self.state_dir)

    async def request(self, op: str, *, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        """
        :raises EmulatorUnavailable: no emulated master answers
        """
        return await rpc.request(self.socket, {"op": op, **fields}, timeout_s=timeout_s)

    async def offer(
        self,
        job_id: str,
        duration_s: float,
        *,
        exit_code: int = 0,
        owner: str = "emulated",
        attributes: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        """Offer a job; the reply says whether it started (see the module doc)"""
        return await self.request(
            "offer",
            job_id=job_id,
            duration_s=duration_s,
            exit_code=exit_code,
            owner=owner,
            attributes=attributes or {},
            timeout_s=timeout_s,
        )

    async def status(self) -> dict[str, Any]:
        return await self.request("status")

    async def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """
        Wait until the emulated startd answers

        :raises TimeoutError: not within ``timeout_s``
        """
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    status = await self.status()
                    if status.get("startd_ready"):
                        return status
                except EmulatorUnavailable:
                    pass
                await asyncio.sleep(0.05)

    def ground_truth(self) -> list[dict[str, Any]]:
        return read_ground_truth(self.state_dir / GROUND_TRUTH_FILE)

    async def wait_for(
        self,
        event: str,
        *,
        timeout_s: float = 60.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """
        The first ground-truth ``event`` whose fields match (and ``where`` holds)

        :raises TimeoutError: none within ``timeout_s``
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for entry in self.ground_truth():
                if entry.get("event") != event:
                    continue
                if any(entry.get(key) != value for key, value in fields.items()):
                    continue
                if where is None or where(entry):
                    return entry
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {event} {fields} within {timeout_s:g}s")
            await asyncio.sleep(0.05)
