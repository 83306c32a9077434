"""The starter's side of the emulated startd: the PREPARE_JOB and JOB_EXIT hooks"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any

from broker.emulation.execution_point.ads import StartdAds
from broker.emulation.execution_point.slots import Job

_STATUS_CODE_RE = re.compile(r"^\s*HookStatusCode\s*=\s*(-?\d+)\s*$", re.I | re.M)
_STATUS_MESSAGE_RE = re.compile(r'^\s*HookStatusMessage\s*=\s*"((?:[^"\\]|\\.)*)"\s*$', re.I | re.M)


class JobHooks(StartdAds):
    """Running the job hooks as the starter does: PREPARE_JOB before, JOB_EXIT after a payload"""

    def _scratch(self, job: Job) -> Path:
        path = self.settings.state_dir / "execute" / f"dir_{self.pid}_{job.number}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def _spawn_hook(
        self, argv: list[str], job: Job, scratch: Path, stdout: int
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=stdout,
            stderr=asyncio.subprocess.PIPE,
            cwd=scratch,
            env=self._hook_env(job, scratch),
        )

    def _hook_env(self, job: Job, scratch: Path) -> dict[str, str]:
        (scratch / ".job.ad").write_text(self.job_ad(job).long())
        (scratch / ".machine.ad").write_text(self.slot_ad(job.slot).long())
        return {
            **os.environ,
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_JOB_AD": str(scratch / ".job.ad"),
            "_CONDOR_MACHINE_AD": str(scratch / ".machine.ad"),
        }

    async def _prepare_job(self, job: Job) -> tuple[str, dict[str, Any]]:
        """Run PREPARE_JOB as the starter does; ``run``, ``idle`` or ``hold`` and details"""
        argv = self.settings.prepare_job
        if not argv:
            return "run", {}
        scratch = self._scratch(job)
        started = time.monotonic()
        try:
            proc = await self._spawn_hook(argv, job, scratch, asyncio.subprocess.PIPE)
        except OSError as err:
            detail = {"hold_subcode": 0, "message": f"failed to execute HOOK_PREPARE_JOB: {err}"}
            self.truth.record(
                "prepare_job", job_id=job.job_id, decision="hold", spawned=False, **detail
            )
            return "hold", detail
        job.hook = proc
        out, errout = await proc.communicate(self.job_ad(job).long().encode())
        job.hook = None
        wall = time.monotonic() - started
        stdout = out.decode("utf-8", errors="replace")
        exit_status = proc.returncode if proc.returncode is not None else -1
        code_match = _STATUS_CODE_RE.search(stdout)
        message_match = _STATUS_MESSAGE_RE.search(stdout)
        message = re.sub(r"\\(.)", r"\1", message_match.group(1)) if message_match else ""
        hook_code = int(code_match.group(1)) if code_match else None
        if exit_status < 0:
            status = exit_status  # killed by a signal: HookStatusCode is ignored
        elif hook_code is not None and hook_code >= 0:
            status = hook_code
        else:
            status = exit_status
        if status == 0:
            decision = "run"
        elif status < 0 or status >= 300:
            decision = "idle"
        else:
            decision = "hold"
        self.truth.record(
            "prepare_job",
            job_id=job.job_id,
            slot=job.slot.name,
            exit_status=exit_status,
            hook_status_code=hook_code,
            message=message,
            wall_s=round(wall, 4),
            decision=decision,
            stderr=errout.decode("utf-8", errors="replace")[-2000:],
        )
        if decision == "hold":
            return "hold", {"hold_reason_code": 19, "hold_subcode": status, "message": message}
        return decision, {"status": status, "message": message}

    async def _job_exit_hook(self, job: Job, reason: str, exit_code: int, runtime: float) -> None:
        argv = self.settings.job_exit
        if not argv:
            return
        ad = self.job_ad(job)
        if exit_code >= 0:
            ad.set("ExitBySignal", False)
            ad.set("ExitCode", exit_code)
        else:
            ad.set("ExitBySignal", True)
            ad.set("ExitSignal", -exit_code)
        ad.set("JobDuration", round(runtime, 3))
        ad.set("ExitReason", "exited normally" if reason == "exit" else "evicted")
        scratch = self._scratch(job)
        started = time.monotonic()
        try:
            proc = await self._spawn_hook([*argv, reason], job, scratch, asyncio.subprocess.DEVNULL)
        except OSError as err:
            self.truth.record(
                "job_exit", job_id=job.job_id, reason=reason, spawned=False, error=str(err)
            )
            return
        timed_out = False
        try:
            async with asyncio.timeout(self.settings.job_exit_timeout_s):
                _, errout = await proc.communicate(ad.long().encode())
        except TimeoutError:
            timed_out = True
            proc.kill()
            await proc.wait()
            errout = b""
        self.truth.record(
            "job_exit",
            job_id=job.job_id,
            reason=reason,
            exit_status=proc.returncode,
            timed_out=timed_out,
            wall_s=round(time.monotonic() - started, 4),
            stderr=errout.decode("utf-8", errors="replace")[-2000:],
        )
