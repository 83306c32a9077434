"""
The emulated execution point: a ``condor_master`` with one startd, in one process

It behaves like an HTCondor EP in the ways the drone agent depends on (``docs/htcondor.md``
section 8), and writes everything that happens to the ground truth. This module: the master's
lifecycle and the control socket's operations.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from broker.emulation.errors import ClassAdSyntaxError
from broker.emulation.execution_point.claims import Claims
from broker.emulation.execution_point.classad import Ad, evaluate, literal
from broker.emulation.execution_point.config import Config
from broker.emulation.execution_point.drain import COMPLETION, DRAIN_HOW
from broker.emulation.execution_point.paths import MASTER_EXIT_FILE
from broker.emulation.execution_point.settings import Settings
from broker.emulation.rpc import serve
from remote_agent.private_dir import private_directory

log = logging.getLogger("emulation.startd")


#: ``MAX_REQUEST`` of the control socket, in bytes
MAX_CONTROL_REQUEST = 1 << 20

#: one operation of the control socket: the startd and the request -> the reply
_ControlOp = Callable[["EmulatedStartd", dict[str, Any]], Awaitable[dict[str, Any]]]


class EmulatedStartd(Claims):
    """The master and its startd; :meth:`run` until the master would exit"""

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until the master exits; its exit code"""
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        self.truth.record("master_started", pid=self.pid, startd=self.settings.startd_name)
        with contextlib.suppress(FileNotFoundError):
            (self.settings.state_dir / MASTER_EXIT_FILE).unlink()
        for sig, how in (
            (signal.SIGTERM, "graceful"),
            (signal.SIGINT, "graceful"),
            (signal.SIGQUIT, "fast"),
        ):
            loop.add_signal_handler(sig, self._on_signal, sig, how)
        loop.add_signal_handler(signal.SIGHUP, lambda: None)  # condor_reconfig: nothing to do
        private_directory(self.control_path.parent)
        server = await serve(self.control_path, self.handle, limit=MAX_CONTROL_REQUEST)
        self._tasks.spawn(self._start_startd())
        self._tasks.spawn(self._master_updates())
        try:
            code, why = await self._exit
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                self.control_path.unlink()
            await self._tasks.cancel()
        self.truth.record("master_exiting", exit_code=code, why=why)
        (self.settings.state_dir / MASTER_EXIT_FILE).write_text(
            json.dumps({"pid": self.pid, "exit_code": code, "why": why})
        )
        self.truth.close()
        return code

    def _finish(self, code: int, why: str) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.set_result((code, why))

    def _on_signal(self, sig: signal.Signals, how: str) -> None:
        self.truth.record("signal", signal=sig.name, how=how)
        if self.shutting_down == "fast" or (self.shutting_down and how == "graceful"):
            return
        self.shutting_down = how
        self._tasks.spawn(self._shutdown(how))

    async def _master_updates(self) -> None:
        """DAEMON_SHUTDOWN is evaluated when the master publishes its ad"""
        while True:
            await asyncio.sleep(self.settings.master_update_s)
            expr = self.settings.daemon_shutdown
            # before the startd ever started, STARTD_StartTime is 0 too: not a shutdown
            if not expr or self.startd_running or self.startd_generation == 0:
                continue
            master_ad = {
                "STARTD_StartTime": literal(int(self.startd_start_time)),
                "MyType": literal("DaemonMaster"),
                "Name": literal(self.settings.startd_name),
            }
            if evaluate(expr, master_ad) is True:
                self._finish(99, "MASTER.DAEMON_SHUTDOWN")
                return

    async def _shutdown(self, how: str) -> None:
        now = time.time()
        for slot in self.slots:
            job = slot.job
            if job is None:
                continue
            if how == "fast":
                self._kill(job, "shutdown_fast")
            else:
                retire = self._retirement_s(job)
                limit = min(
                    job.claimed_at + retire, now + self.settings.shutdown_graceful_timeout_s
                )
                self._schedule_kill(job, max(0.0, limit - now), "shutdown_graceful_timeout")
        while any(slot.job for slot in self.slots):
            self._no_jobs.clear()
            await self._no_jobs.wait()
        if self.startd_running:
            self._stop_startd(f"shutdown {how}", held=False)
        self._finish(0, f"SIGTERM/SIGQUIT ({how} shutdown)")

    def restart_startd(self) -> dict[str, Any]:
        """Emulate a startd crash and restart by the master (only when no job runs)"""
        if any(slot.job for slot in self.slots):
            return {"ok": False, "error": "jobs are running"}
        self._stop_startd("restarted", held=False)
        self._tasks.spawn(self._start_startd())
        return {"ok": True}

    def update_machine_ad(self, text: str) -> dict[str, Any]:
        """``CA_UPDATE_MACHINE_AD``: merge into every slot ad until the startd restarts"""
        if not self.startd_running:
            return {"ok": False, "error": "startd not running"}
        try:
            update = Ad.from_long(text)
        except ClassAdSyntaxError as err:
            return {"ok": False, "error": str(err)}
        for key, name in update.names.items():
            self.truth.record("gate", attribute=name, value=update.source[key])
        self.extras.update(update)
        return {"ok": True}

    # ------------------------------------------------------------------ control socket

    def status(self) -> dict[str, Any]:
        return {
            "master_pid": self.pid,
            "startd_running": self.startd_running,
            "startd_ready": self.startd_ready,
            "startd_pid": self.startd_pid,
            "startd_name": self.settings.startd_name,
            "startd_address": self.startd_address,
            "draining": dataclasses.asdict(self.drain) if self.drain else None,
            "shutting_down": self.shutting_down,
            "extras": {self.extras.names[k]: self.extras.source[k] for k in self.extras.names},
            "slots": [
                {
                    "name": slot.name,
                    "state": slot.state,
                    "activity": slot.activity,
                    "job_id": slot.job.job_id if slot.job else None,
                    "phase": slot.job.phase if slot.job else None,
                }
                for slot in self.slots
            ],
        }

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        handler = self._OPS.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}"}
        return await handler(self, request)

    async def _op_ready_ad(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "ad": self.ready_ad().long()}

    async def _op_slot_ads(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.startd_running:
            return {"ok": True, "running": False, "ads": []}
        ads = [self.slot_ad(slot).long() for slot in self.slots if slot.job is not None]
        return {"ok": True, "running": True, "ads": ads}

    async def _op_locate(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "running": self.startd_running,
            "name": self.settings.startd_name,
            "address": self.startd_address,
            "host": self.settings.host,
        }

    async def _op_update_machine_ad(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.update_machine_ad(str(request.get("ad", "")))

    async def _op_drain(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.startd_running:
            return {"ok": False, "unreachable": True}
        how = request.get("how", "graceful")
        completion = request.get("on_completion", "nothing")
        if how not in DRAIN_HOW or completion not in COMPLETION:
            return {"ok": False, "error": "bad drain request"}
        return self.start_drain(
            how,
            completion,
            str(request.get("reason") or ""),
            request.get("check"),
            request.get("start"),
        )

    async def _op_cancel_drain(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.startd_running:
            return {"ok": False, "unreachable": True}
        return self.cancel_drain(request.get("request_id"))

    async def _op_offer(self, request: dict[str, Any]) -> dict[str, Any]:
        attributes = request.get("attributes") or {}
        if not isinstance(attributes, dict) or not all(
            isinstance(value, int | float | str) for value in attributes.values()
        ):
            return {"ok": False, "error": "attributes must map names to numbers or strings"}
        return {
            "ok": True,
            **await self.offer(
                str(request["job_id"]),
                float(request.get("duration_s", 1.0)),
                int(request.get("exit_code", 0)),
                str(request.get("owner", "emulated")),
                {str(name): value for name, value in attributes.items()},
            ),
        }

    async def _op_status(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, **self.status()}

    async def _op_restart_startd(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.restart_startd()

    async def _op_shutdown(self, request: dict[str, Any]) -> dict[str, Any]:
        self._on_signal(
            signal.SIGQUIT if request.get("fast") else signal.SIGTERM,
            "fast" if request.get("fast") else "graceful",
        )
        return {"ok": True}

    #: the control socket's operations, by the request's ``op``
    _OPS: ClassVar[dict[str, _ControlOp]] = {
        "ready_ad": _op_ready_ad,
        "slot_ads": _op_slot_ads,
        "locate": _op_locate,
        "update_machine_ad": _op_update_machine_ad,
        "drain": _op_drain,
        "cancel_drain": _op_cancel_drain,
        "offer": _op_offer,
        "status": _op_status,
        "restart_startd": _op_restart_startd,
        "shutdown": _op_shutdown,
    }


def run_master(config: Config) -> int:
    """Run the emulated master in the foreground until it exits; its exit code"""
    settings = Settings.from_config(config)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(EmulatedStartd(settings).run())


__all__ = ["EmulatedStartd", "Settings", "run_master"]
