"""
Flood benchmark: a bootstrap flood and an event flood beside a quiet baseline, in one run

Run from the repository root::

    .venv/bin/python bench/flood.py             # 40 s quiet, 25 s per flood, 15 s after each
    .venv/bin/python bench/flood.py --quick     # 15 s quiet, 10 s per flood, 6 s after each
    .venv/bin/python bench/flood.py --event-flood mix   # the event flood mixes in invalid input

A real nats-server in operator mode (``broker/server/auth/``: every drone on its own
credentials, the limits of ``docs/deployment.md#limits``), the streams and buckets as
``broker init`` makes them, and in this process a :class:`~broker.tardis.bus.RemoteBus`
(what COBalD runs for a pool with a ``bus`` section: the real
:class:`~broker.manager.service.ManagerService`, here with its issuer, and TARDIS's
drones on it). The same load runs through every phase:

* ``--drones`` honest drones (default 100) of site ``bench``, each on its own connection
  and credentials, publish what an agent publishes every ``--heartbeat`` s, each awaiting
  its PubAck; an event's *apply* latency is its publish to the moment the manager's
  registry shows it (``registry.view``, polled every 5 ms, matched by ``encoded``);
* TARDIS drones (:class:`~broker.tardis.drone.EventDrone`, as the pool builds them with a
  ``bus`` section), one started every ``1 / --tardis-rate`` s, each with a real in-process
  agent on its own credentials (``_tardis.BenchSite``); once TARDIS has one Available it is
  drained 0.5-2 s later (``Control.drain``), and its agent drains and exits. The lags
  gate open -> Available and drained -> Down (and two more) are read from the stream
  afterwards, as ``bench/lag.py`` reads them;
* site ``siteb`` enrolls a drone every ``1 / --enroll-rate`` s through the agent's own
  request (a process of its own; the tokens minted by ``ManagerService.issuer.mint``),
  each timed from when it was due; an answer not there within the agent's 5 s is a timeout,
  counted, and in the percentiles with the time it took.

The phases, in order: **quiet** (that load alone); **bootstrap flood** (a client on site
``sitea``'s bootstrap credentials sends enrollments to ``sitea``'s issuer subject as fast
as it can, never waiting for an answer; a process of its own); **after bootstrap flood**
(``--after`` s, longer while the issuer still answers the flood's backlog); **event flood**
(one drone of site ``bench`` with its own credentials and its own TARDIS drone publishes
valid events that flip its facts, state, gate and payloads, as fast as it can, never
waiting for an ack; with ``--event-flood mix``, valid events of its own and invalid ones
in turn; a process of its own); **after event flood**.

Printed per phase: p50/p99/max of each latency, each flood phase's p99 as a ratio to
quiet's, and the goal check (within 2x of quiet: yes/no); the CPU seconds of this process
(the manager, the honest drones' clients, TARDIS and its agents) and of the nats-server,
peak RSS, the issuer's counters, and the flooding drone's TARDIS state runs per second.
Writes JSON to ``bench/results/flood-<time>.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import math
import random
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common
from _common import SecuredBus, percentiles
from _flood_bootstrap import bootstrap_flooder, enroller
from _flood_drones import FLOOD_MODES, FLOODER, NS, SITE, Honest, announce, flooder, honest_loop
from _tardis import ROWS, BenchSite, BlindOverlay, States, lags, read_stream, wait_for
from tardis.agents.batchsystemagent import BatchSystemAgent
from tardis.agents.siteagent import SiteAgent

from broker.manager.issuer import Issuer
from broker.server.auth.authority import issuer_key_of, save_issuer_key
from broker.server.auth.credentials import bootstrap_credentials, drone_credentials
from broker.tardis.drone import EventDrone
from broker.tardis_adapter import (
    BusConfig,
    RemoteBatchSystemAdapter,
    RemoteBus,
    RemoteSiteAdapter,
    TardisStateNotes,
)
from remote_agent.protocol.connect import close, connect

#: the site whose bootstrap identity floods, and the site that enrolls meanwhile
FLOODED_SITE, ENROLLING_SITE = "sitea", "siteb"
#: TARDIS's name of site ``bench`` (the bus's site is its lower-case token)
TARDIS_SITE = "Bench"
TARDIS_HEARTBEAT_S = 10
PHASES = ("quiet", "bootstrap flood", "after bootstrap flood", "event flood", "after event flood")
FLOODS = frozenset({"bootstrap flood", "event flood"})
#: a flood phase's p99 within this many times quiet's meets the goal
GOAL_RATIO = 2.0
#: the latencies besides TARDIS's lags (:data:`_tardis.ROWS`)
APPLIED, ENROLLED = "honest event applied", "siteb enrollment"
#: the goals: (flood phase, latency)
GOALS: Sequence[tuple[str, str]] = (
    ("bootstrap flood", ENROLLED),
    ("bootstrap flood", APPLIED),
    ("event flood", "gate open -> Available"),
    ("event flood", "drained -> Down"),
)


# ------------------------------------------------------------------------ measuring


async def watch(
    drones: list[Honest], remote: RemoteBus, samples: list[tuple[float, float]], stop: asyncio.Event
) -> None:
    """Note (sent, latency) for every honest event once the registry shows it"""
    registry = remote.registry
    while not stop.is_set():
        now = time.monotonic()
        for drone in drones:
            if not drone.pending:
                continue
            view = registry.view(SITE, drone.name)
            found = drone.pending.get(view.encoded) if view and view.encoded else None
            if found is None:
                continue
            index = found[0]
            for data, (i, sent) in list(drone.pending.items()):
                if i <= index:
                    del drone.pending[data]
                    samples.append((sent, now - sent))
        await asyncio.sleep(0.005)


def answered(issuer_counts: Mapping[str, int]) -> int:
    """Requests the issuer answered or dropped: everything it counts but the tokens minted"""
    return sum(n for name, n in issuer_counts.items() if name != "minted")


def rss_mb(pid: int | None = None) -> float:
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@dataclass
class Sampler:
    """Every 0.25 s: RSS of this process and the server, and how much the issuer has done"""

    server_pid: int
    remote: RemoteBus
    #: (time.monotonic(), own RSS MB, server RSS MB, the issuer's answers so far)
    samples: list[tuple[float, float, float, int]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(
                (
                    time.monotonic(),
                    rss_mb(),
                    rss_mb(self.server_pid),
                    answered(self.remote.manager.issuer_counts),
                )
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    def answers_per_s(self, window_s: float = 1.0) -> float:
        """The issuer's answers per second over the last ``window_s``"""
        if len(self.samples) < 2:
            return math.inf
        now, *_, so_far = self.samples[-1]
        since = next(s for s in self.samples if s[0] >= now - window_s)
        return (so_far - since[3]) / max(now - since[0], 1e-3)


@dataclass(frozen=True)
class Mark:
    """The counters at a phase boundary"""

    mono: float
    wall: float
    manager_cpu_s: float
    server_cpu_s: float
    issuer: dict[str, int]
    delivered: int
    rejected: int
    flooder_state_runs: int
    woken: dict[str, int]


def mark(bus: SecuredBus, remote: RemoteBus, flood_drone: EventDrone) -> Mark:
    assert bus.server.pid is not None
    return Mark(
        mono=time.monotonic(),
        wall=time.time(),
        manager_cpu_s=_common.cpu_seconds(),
        server_cpu_s=_common.cpu_seconds(bus.server.pid),
        issuer=dict(remote.manager.issuer_counts),
        delivered=remote.manager.consumer_stats.delivered,
        rejected=remote.registry.metrics().rejected_total,
        flooder_state_runs=flood_drone.state_runs,
        woken=dict(remote.waker.counts),
    )


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


# ------------------------------------------------------------------------ TARDIS


class Cycle:
    """
    TARDIS drones started one every ``1 / rate`` s, each drained 0.5-2 s after it is Available

    A TARDIS plugin besides: it sees each drone's state change.
    """

    def __init__(
        self,
        remote: RemoteBus,
        site_agent: SiteAgent,
        batch_agent: BatchSystemAgent,
        plugins: list[Any],
        rate: float,
        rng: random.Random,
    ) -> None:
        self.remote = remote
        self.site_agent, self.batch_agent = site_agent, batch_agent
        self.plugins = [*plugins, self]
        self.rate, self.rng = rate, rng
        #: the drones the cycle started, by uuid, and their tasks
        self.drones: dict[str, EventDrone] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.drain_failed = 0
        self._draining: set[str] = set()
        self._drains: set[asyncio.Task[None]] = set()

    def drone(self, uuid: str) -> tuple[EventDrone, asyncio.Task[None]]:
        """A TARDIS drone on the bus, running"""
        drone = EventDrone(
            site_agent=self.site_agent,
            batch_system_agent=self.batch_agent,
            plugins=list(self.plugins),
            drone_uuid=uuid,
            waker=self.remote.waker,
        )
        return drone, asyncio.create_task(drone.run())

    async def run(self, stop: asyncio.Event) -> None:
        started = time.monotonic()
        i = 0
        while not stop.is_set():
            uuid = _common.drone_name(SITE, 0xA000000 + i)
            self.drones[uuid], task = self.drone(uuid)
            self.tasks.append(task)
            i += 1
            with contextlib.suppress(TimeoutError):
                due = started + i / self.rate
                await asyncio.wait_for(stop.wait(), max(0.0, due - time.monotonic()))

    async def notify(self, state: Any, resource_attributes: Any) -> None:
        uuid = str(resource_attributes["drone_uuid"])
        if str(state) == "AvailableState" and uuid in self.drones and uuid not in self._draining:
            self._draining.add(uuid)
            task = asyncio.create_task(self._drain(uuid, self.rng.uniform(0.5, 2.0)))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)

    async def _drain(self, uuid: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        try:
            control = self.remote.control
            assert control is not None, "the bus is not connected"
            await control.drain(SITE, uuid, self.remote.drain_deadline(), "bench")
        except Exception:  # counted: that drone's lags are missing
            self.drain_failed += 1

    async def finish(self, timeout_s: float) -> int:
        """Wait for the drones started to be Down; how many were not within ``timeout_s``"""
        if not self.tasks:
            return 0
        _, pending = await asyncio.wait(self.tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, *self._drains, return_exceptions=True)
        return len(pending)


# ------------------------------------------------------------------------ the run


class Flooder:
    """
    A flooding process of this script, started ahead (its imports are no part of a phase)

    It says ``ready``, waits for a line on its stdin (none: it ends without flooding),
    floods, and prints what it did as JSON.
    """

    def __init__(self, *args: str) -> None:
        self.args = args
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *self.args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        said = await asyncio.wait_for(self.process.stdout.readline(), 60)
        if said != b"ready\n":
            raise RuntimeError(f"a flooding process did not start: {said!r}")

    async def flood(self) -> dict[str, Any]:
        """
        Flood now; what it did, once it is done

        :raises RuntimeError: if it failed
        """
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        await self.process.stdin.drain()
        out, _ = await self.process.communicate()
        if self.process.returncode != 0:
            raise RuntimeError(f"a flooding process failed ({self.process.returncode})")
        result: dict[str, Any] = json.loads(out)
        return result

    async def stop(self) -> None:
        """End it if it still runs"""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def start_enroller(
    url: str, issuer: Issuer, creds: Path, rate: float, seconds: float, tmp: Path
) -> tuple[asyncio.subprocess.Process, Path]:
    """
    The enrolling site's process, with a token minted for each drone it may enroll

    It ends when its stdin is closed and writes what it did (JSON) to the file returned.
    """
    names = [_common.drone_name(ENROLLING_SITE, i) for i in range(math.ceil(rate * seconds))]
    drones = [
        {
            "site": ENROLLING_SITE,
            "name": name,
            "token": await issuer.mint(ENROLLING_SITE, name),
            "creds": str(creds),
        }
        for name in names
    ]
    spec, out = tmp / "enroll.json", tmp / "enrolled.json"
    spec.write_text(json.dumps({"url": url, "rate_per_s": rate, "drones": drones}))
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--enroller", str(spec), str(out), stdin=subprocess.PIPE
    )
    return process, out


def phase(
    lo: Mark,
    hi: Mark,
    applied: Sequence[tuple[float, float]],
    enrollments: Sequence[tuple[float, float, str]],
    tardis: Mapping[str, Sequence[tuple[dt.datetime, float]]],
    samples: Sequence[tuple[float, float, float, int]],
) -> dict[str, Any]:
    """What happened from ``lo`` to ``hi``: the latencies of what began then, the counters"""
    seconds = hi.mono - lo.mono
    wall_lo = dt.datetime.fromtimestamp(lo.wall, dt.UTC)
    wall_hi = dt.datetime.fromtimestamp(hi.wall, dt.UTC)
    enrolled = [(took, outcome) for due, took, outcome in enrollments if lo.mono <= due < hi.mono]
    latency = {
        APPLIED: percentiles([lat for sent, lat in applied if lo.mono <= sent < hi.mono]),
        ENROLLED: percentiles([took for took, _ in enrolled]),
    }
    for row, found in tardis.items():
        latency[row] = percentiles([lag for at, lag in found if wall_lo <= at < wall_hi])
    picked = [s for s in samples if lo.mono <= s[0] < hi.mono] or [(0.0, 0.0, 0.0, 0)]
    runs = hi.flooder_state_runs - lo.flooder_state_runs
    return {
        "seconds": seconds,
        "latency": latency,
        "enroll_outcomes": dict(collections.Counter(outcome for _, outcome in enrolled)),
        "manager_cpu_s": hi.manager_cpu_s - lo.manager_cpu_s,
        "server_cpu_s": hi.server_cpu_s - lo.server_cpu_s,
        "manager_rss_mb": max(s[1] for s in picked),
        "server_rss_mb": max(s[2] for s in picked),
        "issuer": delta(hi.issuer, lo.issuer),
        "events_delivered": hi.delivered - lo.delivered,
        "rejected": hi.rejected - lo.rejected,
        "flooder_state_runs": runs,
        "flooder_state_runs_per_s": runs / seconds,
        "woken": delta(hi.woken, lo.woken),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(10)
    async with _common.secured_bus(NS, prefix="cobald-remote-flood-") as bus:
        tmp = bus.tmp
        # the manager logs as in a deployment (INFO, to a file): what that costs is measured
        log_file = tmp / "manager.log"
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        key_file = tmp / "issuer.key"
        save_issuer_key(issuer_key_of(bus.authority), key_file)
        creds: dict[str, Path] = {}
        for site in (FLOODED_SITE, ENROLLING_SITE):
            creds[site] = tmp / f"bootstrap-{site}.creds"
            creds[site].write_text(bootstrap_credentials(bus.authority, NS, site))

        def drone_creds(name: str) -> Path:
            path = tmp / f"{name}.creds"
            path.write_text(drone_credentials(bus.authority, NS, SITE, name))
            return path

        remote = RemoteBus(
            BusConfig.from_mapping(
                {
                    "servers": bus.url,
                    "creds": str(bus.manager_creds),
                    "bootstrap_key": str(key_file),
                    "lost_after_s": 600,
                }
            ),
            register=False,
        )
        bus_task = asyncio.create_task(remote.run())
        assert await remote.wait_ready(60), "the bus did not connect"
        issuer = remote.manager.issuer
        assert issuer is not None and bus.server.pid is not None
        admin = await connect(bus.url, user_credentials=str(bus.manager_creds))

        # the load of every phase: honest drones, TARDIS's drones, site B's enrollments
        drones: list[Honest] = []
        for i in range(args.drones):
            name = _common.drone_name(SITE, i + 1)
            nc = await connect(
                bus.url, user_credentials=str(drone_creds(name)), inbox_prefix=f"_INBOX_{name}"
            )
            drones.append(Honest(name, nc, 1_000_000, random.Random(rng.random())))
        flood_creds = drone_creds(FLOODER)
        site = BenchSite(
            lambda drone: _common.agent_settings(bus, SITE, drone, 30.0, drone_creds(drone)),
            TARDIS_HEARTBEAT_S,
            rng,
            TARDIS_SITE,
            external={FLOODER},
        )
        states = States()
        cycle = Cycle(
            remote,
            SiteAgent(RemoteSiteAdapter(site, remote)),
            BatchSystemAgent(RemoteBatchSystemAdapter(BlindOverlay(), remote)),
            [TardisStateNotes(remote), states],
            args.tardis_rate,
            rng,
        )
        flood_drone, flood_task = cycle.drone(FLOODER)
        await announce(bus.url, str(flood_creds))
        planned_s = args.warmup + args.quiet + 2 * (args.flood + args.after) + 120
        enrolling, enrolled_file = await start_enroller(
            bus.url, issuer, creds[ENROLLING_SITE], args.enroll_rate, planned_s, tmp
        )
        # the flooded site runs drones too: its file is on them, and its site has grants
        await issuer.mint(FLOODED_SITE, _common.drone_name(FLOODED_SITE, 0))

        stop, stop_cycle = asyncio.Event(), asyncio.Event()
        applied: list[tuple[float, float]] = []
        sampler = Sampler(bus.server.pid, remote)
        tasks = [asyncio.create_task(honest_loop(d, args.heartbeat, stop)) for d in drones]
        tasks.append(asyncio.create_task(watch(drones, remote, applied, stop)))
        tasks.append(asyncio.create_task(sampler.run(stop)))
        tasks.append(asyncio.create_task(cycle.run(stop_cycle)))  # awaited once it stopped

        marks: list[Mark] = []

        def begin() -> None:
            marks.append(mark(bus, remote, flood_drone))

        flooders = (
            Flooder("--bootstrap-flooder", bus.url, str(creds[FLOODED_SITE]), str(args.flood)),
            Flooder("--flooder", bus.url, str(flood_creds), str(args.flood), args.event_flood),
        )
        try:
            for flooder_process in flooders:
                await flooder_process.start()
            await asyncio.sleep(args.warmup)
            await wait_for(
                lambda: states.latest.get(FLOODER) == "AvailableState", 60, "the flooder Available"
            )
            begin()  # quiet
            await asyncio.sleep(args.quiet)
            begin()  # the bootstrap flood
            bootstrap = await flooders[0].flood()
            begin()  # after it
            await asyncio.sleep(args.after)
            calm = 2 * args.enroll_rate + 10
            with contextlib.suppress(TimeoutError):  # the issuer's backlog: a minute at most
                await wait_for(lambda: sampler.answers_per_s() <= calm, 60, "the issuer calm")
            begin()  # the event flood
            event = await flooders[1].flood()
            begin()  # after it
            await asyncio.sleep(args.after)
            begin()  # the end
            assert enrolling.stdin is not None
            enrolling.stdin.close()
            await asyncio.wait_for(enrolling.wait(), 30)
        finally:
            for flooder_process in flooders:
                await flooder_process.stop()
            if enrolling.returncode is None:
                enrolling.kill()
                await enrolling.wait()
        enrolled = json.loads(enrolled_file.read_text())
        stop_cycle.set()
        not_down = await cycle.finish(60)
        flood_task.cancel()
        await asyncio.gather(flood_task, return_exceptions=True)
        stop.set()
        await asyncio.gather(*tasks)
        await wait_for(lambda: not remote.pending_notes, 30, "the notes published")
        await asyncio.gather(*site.agents.values(), return_exceptions=True)
        info = await admin.jetstream().stream_info(
            NS.event_stream, subjects_filter=f"{NS.drone_root(SITE, FLOODER)}.>"
        )
        messages = await read_stream(admin, NS, SITE, set(cycle.drones))
        for drone in drones:
            await close(drone.nc)
        await close(admin)
        remote.stop()
        await asyncio.wait_for(bus_task, 30)
        logging.getLogger().removeHandler(handler)
        handler.close()
        log_lines = len(log_file.read_text().splitlines())

    tardis = lags(messages, set(cycle.drones))
    phases = {
        name: phase(lo, hi, applied, enrolled["enrollments"], tardis, sampler.samples)
        for name, lo, hi in zip(PHASES, marks[:-1], marks[1:], strict=True)
    }
    unapplied = sum(len(d.pending) for d in drones)
    return {
        "args": vars(args),
        "phases": phases,
        "goals": goals(phases),
        "bootstrap_flooder": bootstrap,
        "event_flooder": event,
        "enroller": {k: v for k, v in enrolled.items() if k != "enrollments"},
        "tardis_drones": len(cycle.drones),
        "tardis_not_down": not_down,
        "tardis_drains_failed": cycle.drain_failed,
        "honest_published": sum(d.published for d in drones),
        "honest_unapplied_at_end": unapplied,
        "flooder_kept_in_stream": dict(info.state.subjects or {}),
        "issuer_counts": dict(remote.manager.issuer_counts),
        "manager_session_failures": remote.manager.failures,
        "manager_log_lines": log_lines,
    }


def goals(phases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal's p99s, their ratio, and whether it is within :data:`GOAL_RATIO`"""
    out = []
    for flood, row in GOALS:
        quiet = phases["quiet"]["latency"][row]["p99_ms"]
        flooded = phases[flood]["latency"][row]["p99_ms"]
        ratio = flooded / quiet if quiet > 0 else math.nan
        out.append(
            {
                "phase": flood,
                "row": row,
                "quiet_p99_ms": quiet,
                "p99_ms": flooded,
                "ratio": ratio,
                "met": bool(ratio <= GOAL_RATIO),
            }
        )
    return out


# ------------------------------------------------------------------------ the report


def latency_table(phases: dict[str, dict[str, Any]], row: str, title: str) -> str:
    """``row``'s latency in every phase, with the p99 over quiet's"""
    quiet = phases["quiet"]["latency"][row]["p99_ms"]
    enroll = row == ENROLLED
    rows = []
    for name in PHASES:
        p = phases[name]["latency"][row]
        ratio = p["p99_ms"] / quiet if quiet > 0 else math.nan
        flood = name in FLOODS
        cells: list[object] = [name, p["count"]]
        if enroll:
            outcomes = phases[name]["enroll_outcomes"]
            cells.append(sum(n for k, n in outcomes.items() if k != "issued"))
        cells += [
            p["p50_ms"],
            p["p99_ms"],
            p["max_ms"],
            "-" if name == "quiet" else f"{ratio:.2f}",
            ("yes" if ratio <= GOAL_RATIO else "no") if flood else "-",
        ]
        rows.append(cells)
    header = ["phase", "n", *(["not issued"] if enroll else []), "p50 ms", "p99 ms", "max ms"]
    header += ["p99 / quiet", "within 2x"]
    return f"{title}\n{_common.table(header, rows)}"


def render(report: dict[str, Any]) -> str:
    phases = report["phases"]
    parts = [
        latency_table(phases, APPLIED, "honest drones' events, publish -> registry:"),
        latency_table(
            phases, ENROLLED, "siteb's enrollments (a timeout counts with its time, >= 5 s):"
        ),
    ]
    for row, _, _ in ROWS:
        parts.append(latency_table(phases, row, f"TARDIS drones, {row}:"))
    rows = []
    for name in PHASES:
        p = phases[name]
        rows.append(
            [
                name,
                p["seconds"],
                p["manager_cpu_s"],
                f"{100 * p['manager_cpu_s'] / p['seconds']:.0f} %",
                p["server_cpu_s"],
                p["manager_rss_mb"],
                p["server_rss_mb"],
                p["events_delivered"],
                p["rejected"],
                answered(p["issuer"]),
                p["flooder_state_runs_per_s"],
            ]
        )
    header = [
        "phase",
        "s",
        "manager CPU s",
        "CPU",
        "server CPU s",
        "manager MB",
        "server MB",
        "events read",
        "rejected",
        "issuer answers",
        "flooder TARDIS runs/s",
    ]
    parts.append(_common.table(header, rows))
    parts.append("\n".join(f"issuer, {name}: {phases[name]['issuer']}" for name in PHASES))
    b, e = report["bootstrap_flooder"], report["event_flooder"]
    parts.append(
        f"bootstrap flooder: {b['sent']:,} requests in {b['seconds']:.1f} s "
        f"({b['sent'] / b['seconds']:,.0f}/s, {b['cpu_s']:.1f} CPU s); the issuer answered or "
        f"dropped {answered(report['issuer_counts']):,} "
        f"requests in the whole run (siteb's included): the rest never reached it; "
        f"manager sessions failed {report['manager_session_failures']}\n"
        f"event flooder ({report['args']['event_flood']}): "
        f"{e['sent']:,} messages ({e['valid']:,} valid) in {e['seconds']:.1f} s "
        f"({e['sent'] / e['seconds']:,.0f}/s, {e['cpu_s']:.1f} CPU s), kept in the stream: "
        f"{report['flooder_kept_in_stream']}\n"
        f"TARDIS drones cycled {report['tardis_drones']} (not Down at the end "
        f"{report['tardis_not_down']}, drains failed {report['tardis_drains_failed']}); "
        f"honest events published {report['honest_published']:,}, not applied at the end "
        f"{report['honest_unapplied_at_end']}; manager log lines {report['manager_log_lines']:,}"
    )
    lines = [f"goals (p99 within {GOAL_RATIO:.0f}x of quiet):"]
    for goal in report["goals"]:
        lines.append(
            f"  {goal['phase']}: {goal['row']} p99 {goal['p99_ms']:,.2f} ms / quiet "
            f"{goal['quiet_p99_ms']:,.2f} ms = {goal['ratio']:.2f}: "
            + ("yes" if goal["met"] else "no")
        )
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--flooder"], ["--bootstrap-flooder"]):
        print("ready", flush=True)
        if not sys.stdin.readline():
            return 1  # the benchmark ended before its flood
        url, creds, duration = argv[1], argv[2], float(argv[3])
        if argv[0] == "--flooder":
            done = asyncio.run(flooder(url, creds, duration, argv[4]))
        else:
            done = asyncio.run(bootstrap_flooder(url, creds, FLOODED_SITE, duration))
        print(json.dumps(done))
        return 0
    if argv[:1] == ["--enroller"]:
        report = asyncio.run(enroller(json.loads(Path(argv[1]).read_text())))
        Path(argv[2]).write_text(json.dumps(report))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drones", type=int, default=100, help="honest drones (default 100)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="seconds between events")
    parser.add_argument(
        "--tardis-rate", type=float, default=2.0, help="TARDIS drones started per second (2)"
    )
    parser.add_argument(
        "--enroll-rate", type=float, default=10.0, help="siteb enrollments per second (10)"
    )
    parser.add_argument(
        "--event-flood",
        choices=FLOOD_MODES,
        default="flips",
        help="what the flooding drone sends (flips: valid fact flips only)",
    )
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before quiet")
    parser.add_argument("--quiet", type=float, default=40.0, help="seconds of quiet")
    parser.add_argument("--flood", type=float, default=25.0, help="seconds of each flood")
    parser.add_argument("--after", type=float, default=15.0, help="seconds after each flood")
    parser.add_argument("--quick", action="store_true", help="15 s quiet, 10 s floods, 6 s after")
    parser.add_argument("--out", type=Path, help="directory for the JSON (bench/results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.quiet, args.flood, args.after = 3.0, 15.0, 10.0, 6.0
    budget = args.warmup + args.quiet + 2 * (args.flood + args.after) + 300
    report = _common.run_bounded(run(args), budget)
    print(render(report))
    print(f"written to {_common.write_result('flood', report, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
