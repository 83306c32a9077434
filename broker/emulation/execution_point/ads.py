"""The emulated master's and startd's ClassAds: ready ad, slot ads, job ads"""

from __future__ import annotations

import contextlib
import time

from broker.emulation.errors import ClassAdSyntaxError
from broker.emulation.execution_point.classad import Ad
from broker.emulation.execution_point.slots import Job, Slot
from broker.emulation.execution_point.state import StartdState


class StartdAds(StartdState):
    """The ads the master and the startd publish, built from the state"""

    @property
    def startd_address(self) -> str:
        port = 9618
        return (
            f"<127.0.0.1:{port}?addrs=127.0.0.1-{port}&alias={self.settings.host}"
            f"&noUDP&sock=startd_{self.pid}_{self.startd_generation:04x}>"
        )

    @property
    def master_address(self) -> str:
        return (
            f"<127.0.0.1:9618?addrs=127.0.0.1-9618&alias={self.settings.host}"
            f"&noUDP&sock=master_{self.pid}_0001>"
        )

    def ready_ad(self) -> Ad:
        """The master's answer to DC_QUERY_READY (``Daemons::InitDaemonReadyAd``)"""
        ad = Ad()
        ad.set("MASTER", "Alive")
        ad.set("MASTER_PID", self.pid)
        ad.set("MASTER_Addr", self.master_address)
        if self.startd_running:
            ad.set("STARTD", "Alive")
            ad.set("STARTD_PID", self.startd_pid)
            ad.set("STARTD_Addr", self.startd_address)
            if self.startd_ready:
                ad.set("STARTD_State", "Ready")
        else:
            ad.set("STARTD", "Hold" if self.startd_held else "Startup")
            ad.set("STARTD_PID", 0)
        alive = 1 + int(self.startd_running)
        ad.set("NumDaemons", 2)
        ad.set("NumAlive", alive)
        ad.set("NumStartup", int(not self.startd_running and not self.startd_held))
        ad.set("NumHung", 0)
        ad.set("NumHold", int(self.startd_held))
        ad.set("NumDead", 0)
        ad.set("IsReady", self.startd_running or self.startd_held)
        if self.shutting_down:
            ad.set("InShutdownMode", "Exit")
        return ad

    def slot_ad(self, slot: Slot) -> Ad:
        ad = Ad()
        ad.set("MyType", "Machine")
        ad.set("Name", slot.name)
        ad.set("Machine", self.settings.host)
        ad.set("MyAddress", self.startd_address)
        ad.set("SlotID", slot.slot_id)
        ad.set("SlotType", slot.kind)
        ad.set("PartitionableSlot", slot.kind == "Partitionable")
        if slot.kind == "Dynamic":
            ad.set("DynamicSlot", True)
        ad.set("Cpus", slot.cpus)
        ad.set("Memory", 2048 * slot.cpus)
        ad.set("State", slot.state)
        ad.set("Activity", slot.activity)
        ad.set("EnteredCurrentState", int(slot.entered))
        ad.set("EnteredCurrentActivity", int(slot.entered))
        ad.set("Draining", self.drain is not None)
        if self.drain is not None:
            ad.set("DrainReason", self.drain.reason)
            ad.set("DrainingRequestId", self.drain.request_id)
        ad.set_expr("Start", self.settings.start_expr)
        with contextlib.suppress(ClassAdSyntaxError):
            ad.set_expr("MaxJobRetirementTime", self.settings.retirement_expr)
        ad.set("LastDrainStartTime", int(self.drain.started_at) if self.drain else 0)
        job = slot.job
        if job is not None:
            ad.set("JobId", job.job_id)
            ad.set("GlobalJobId", f"submit.emulated#{job.job_id}#{int(job.claimed_at)}")
            ad.set("RemoteOwner", f"{job.owner}@emulated")
            ad.set("RemoteUser", f"{job.owner}@emulated")
            ad.set("ClientMachine", "submit.emulated")
            ad.set("JobStart", int(job.claimed_at))
            ad.set("TotalJobRunTime", int(time.time() - job.claimed_at))
        ad.update(self.extras)
        return ad

    def job_ad(self, job: Job) -> Ad:
        cluster, proc = job.cluster_proc
        ad = Ad()
        ad.set("MyType", "Job")
        ad.set("ClusterId", cluster)
        ad.set("ProcId", proc)
        ad.set("Owner", job.owner)
        ad.set("User", f"{job.owner}@emulated")
        ad.set("GlobalJobId", f"submit.emulated#{job.job_id}#{int(job.claimed_at)}")
        ad.set("Cmd", "/bin/sleep")
        ad.set("Arguments", f"{job.duration_s:g}")
        ad.set("RequestCpus", 1)
        ad.set("JobUniverse", 5)
        ad.set("RemoteHost", job.slot.name)
        ad.set("QDate", int(job.claimed_at))
        for name, value in job.attributes.items():
            ad.set(name, value)
        return ad
