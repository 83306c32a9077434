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
from typing import Any

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
        if op == "ready_ad":
            return {"ok": True, "ad": self.ready_ad().long()}
        if op == "slot_ads":
            if not self.startd_running:
                return {"ok": True, "running": False, "ads": []}
            ads = [self.slot_ad(slot).long() for slot in self.slots if slot.job is not None]
            return {"ok": True, "running": True, "ads": ads}
        if op == "locate":
            return {
                "ok": True,
                "running": self.startd_running,
                "name": self.settings.startd_name,
                "address": self.startd_address,
                "host": self.settings.host,
            }
        if op == "update_machine_ad":
            return self.update_machine_ad(str(request.get("ad", "")))
        if op == "drain":
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
        if op == "cancel_drain":
            if not self.startd_running:
                return {"ok": False, "unreachable": True}
            return self.cancel_drain(request.get("request_id"))
        if op == "offer":
            return {
                "ok": True,
                **await self.offer(
                    str(request["job_id"]),
                    float(request.get("duration_s", 1.0)),
                    int(request.get("exit_code", 0)),
                    str(request.get("owner", "emulated")),
                ),
            }
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "restart_startd":
            return self.restart_startd()
        if op == "shutdown":
            self._on_signal(
                signal.SIGQUIT if request.get("fast") else signal.SIGTERM,
                "fast" if request.get("fast") else "graceful",
            )
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}


def run_master(config: Config) -> int:
    """Run the emulated master in the foreground until it exits; its exit code"""
    settings = Settings.from_config(config)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(EmulatedStartd(settings).run())


__all__ = ["EmulatedStartd", "Settings", "run_master"]
