"""
Black-hole sites: a site whose drones die at once, or run payloads that all fail at once, and
the probe drones such a site still gets

Its rule (:class:`BlackHoles`, a registry watcher, so a rebuilt registry tells it what it
restores). A drone is a *black hole* when

- ``died``: it ended without ever starting a payload and without being asked to end (no
  release, no drain intent in its record or its snapshot), within ``lifetime_s`` of its agent's
  start by its agent's clock (a span on one clock), or before its agent ever spoke; or
- ``failing``: :data:`FAILED_PAYLOADS` of its payloads ended in a row as fast failures (held, a
  non-zero exit or vanished, within :data:`FAST_FAILURE_S` of their start) while payloads ran
  well on another site within :data:`ELSEWHERE_S`, so a user's broken jobs, which fail on every
  site alike, flag none.

A site is *flagged* while its last ``drones`` black holes of one kind came in a row: a payload
that starts on any drone of the site ends a run of ``died``, a payload that runs well (a clean
exit, or :data:`FAST_FAILURE_S` of runtime) ends both. Each drone gets at most one verdict, each
payload end counts once (by its drone, incarnation and ``seq``). While a site is flagged,
:meth:`BlackHoles.allowance` lets the pool ask for one probe drone per backoff period, the
period doubling from ``backoff_s`` up to ``backoff_max_s``; a new flag starts at ``backoff_s``.

Written in the thread that applies the registry's messages; the pool reads the flags from
COBalD's thread (a dict replaced whole), and only the pool's thread keeps the probes.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Final

from broker.manager.lifecycle import Ending
from broker.manager.views import DroneView
from remote_agent.protocol.events import (
    AnyEvent,
    DroneState,
    PayloadEnd,
    PayloadFinished,
    RecordPhase,
)
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.registry")
_lines = RateLimitedLog(log, interval_s=60.0)

#: default black holes in a row that flag a site (``0``: the detector is off)
DEFAULT_BLACK_HOLE_DRONES: Final = 3
#: default seconds from its agent's start within which a drone that ended unasked, without
#: a payload, is a black hole
DEFAULT_BLACK_HOLE_LIFETIME_S: Final = 600.0
#: default seconds a flagged site waits for its first probe drone, doubled after each
DEFAULT_BLACK_HOLE_BACKOFF_S: Final = 300.0
#: default longest wait between two probe drones of a flagged site, seconds
DEFAULT_BLACK_HOLE_BACKOFF_MAX_S: Final = 3600.0
#: payload ends in a row on one drone, each a fast failure, that make it a black hole
FAILED_PAYLOADS: Final = 5
#: a payload that ended within this many seconds of its start without a clean exit failed fast;
#: one that ran this long ran well, however it ended
FAST_FAILURE_S: Final = 60.0
#: a drone's failing payloads count only if a payload ran well on another site this recently
ELSEWHERE_S: Final = 3600.0
#: drones whose facts or verdict are kept at most (the oldest are forgotten first)
TRACKED: Final = 100_000

_STARTED: Final = "payload_started"
_FINISHED: Final = "payload_finished"
#: payload ends that say nothing of the site: the schedd or a drain took the payload away
_NEUTRAL: Final = frozenset({PayloadEnd.REMOVE, PayloadEnd.EVICT})
_ASKED_ENDS: Final = frozenset({Ending.RELEASED, Ending.DEADLINE_EXPIRED})


def cleanup_note(action: str) -> str:
    """
    The note (a release's, a drain's reason) of TARDIS removing a drone's job on its own:
    its ``stop`` or ``terminate`` of a job it found failed or gone, while no demand fell
    (the pool's releases carry its own reason). Such a removal asked the drone nothing.
    """
    return f"TARDIS {action}"


#: the notes of TARDIS's own removals (:func:`cleanup_note`)
CLEANUP_NOTES: Final = frozenset(cleanup_note(action) for action in ("stop", "terminate"))
_ASKED_PHASES: Final = frozenset({RecordPhase.RELEASED, RecordPhase.DEADLINE_EXPIRED})


class Verdict(enum.StrEnum):
    """Why a drone is a black hole"""

    DIED = "died"  #: it ended unasked within the lifetime, without a payload
    FAILING = "failing"  #: its payloads failed fast, in a row, while others ran well elsewhere


#: what each verdict says of a drone (``its``) or of drones in a row (``their``)
MEANING: Final[dict[Verdict, str]] = {
    Verdict.DIED: "ended unasked, without a payload, within {lifetime:.0f}s of {its} agent's start",
    Verdict.FAILING: f"had {FAILED_PAYLOADS} payloads in a row fail within "
    f"{FAST_FAILURE_S:.0f}s of their start while payloads ran well on another site",
}


@dataclass(frozen=True, slots=True)
class Rules:
    """
    The detector's thresholds (the ``bus:`` keys ``black_hole_*``)

    :param drones: black holes in a row that flag a site; ``0``: the detector is off
    :param lifetime_s: a drone that ended unasked without a payload within this many
        seconds of its agent's start is a black hole
    :param backoff_s: seconds a flagged site waits for its first probe drone
    :param backoff_max_s: the longest wait between two probe drones, seconds
    """

    drones: int = DEFAULT_BLACK_HOLE_DRONES
    lifetime_s: float = DEFAULT_BLACK_HOLE_LIFETIME_S
    backoff_s: float = DEFAULT_BLACK_HOLE_BACKOFF_S
    backoff_max_s: float = DEFAULT_BLACK_HOLE_BACKOFF_MAX_S

    def meaning(self, verdict: Verdict, its: str = "its") -> str:
        """What ``verdict`` says, in words; ``its="their"`` for drones in a row"""
        return MEANING[verdict].format(lifetime=self.lifetime_s, its=its)


@dataclass(frozen=True, slots=True)
class Flag:
    """A site flagged as a black hole"""

    verdict: Verdict
    drones: int  #: black holes in a row so far
    last: str  #: the newest of them
    since: float  #: the bus time of the verdict that flagged it, epoch seconds
    number: int  #: which flag of the site this is (a probe schedule belongs to one flag)


@dataclass(slots=True)
class _Drone:
    """What one drone did so far: whether a payload started, its fast failures in a row"""

    started: bool = False
    failures: int = 0
    #: the ``(incarnation, seq)`` of the last payload end counted
    last_end: tuple[str, int] | None = None


@dataclass(slots=True)
class _Site:
    died: int = 0  #: ``died`` verdicts in a row since a payload started
    failing: int = 0  #: ``failing`` verdicts in a row since a payload ran well
    last: str = ""
    #: the bus time of the newest payload of the site that ran well
    ran_well: float | None = None
    flags: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(slots=True)
class _Probes:
    """The probe schedule of one flag, on the pool's monotonic clock"""

    number: int
    next_at: float
    period_s: float


class BlackHoles:
    """
    Black-hole drones per site, the sites flagged, and their probe drones (see the module)

    :param rules: the thresholds; ``rules.drones == 0`` turns the detector off
    :param tell: log its verdicts and flags (the manager does; ``status`` shows them itself)
    """

    def __init__(self, rules: Rules | None = None, *, tell: bool = True) -> None:
        self.rules = rules or Rules()
        self.tell = tell
        self._drones: dict[tuple[str, str], _Drone] = {}
        #: the drones that got their verdict (``None``: not a black hole), oldest first
        self._decided: dict[tuple[str, str], Verdict | None] = {}
        self._sites: dict[str, _Site] = {}
        #: the flagged sites, replaced whole on every change (read from COBalD's thread)
        self.flags: dict[str, Flag] = {}
        self._probes: dict[str, _Probes] = {}
        #: probe drones asked for and adjustments withheld, by site (the pool's thread)
        self.probes: collections.Counter[str] = collections.Counter()
        self.withheld: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ readers

    def verdict(self, site: str, drone: str) -> Verdict | None:
        """The drone's verdict, if it is a black hole"""
        return self._decided.get((site, drone))

    def counts(self) -> dict[str, dict[str, int]]:
        """Black-hole drones by site and verdict, since the detector started (any thread)"""
        return {name: dict(site.counts) for name, site in self._sites.copy().items() if site.counts}

    # ------------------------------------------------------------------ the watcher

    def seen(self, view: DroneView) -> None:
        """A registry watcher: the drone's new view (quick; decodes only payload ends and ends)"""
        if not self.rules.drones:
            return
        key = view.key
        kind = view.kind
        drone = self._drones.get(key)
        if drone is None:
            if key in self._decided:
                # no second verdict, but what it runs still speaks for its site
                if kind == _STARTED or view.state is DroneState.BUSY:
                    self._payload_started(view)
                elif kind == _FINISHED and _ran_well(view.event):
                    self._payload_ran_well(view)
                return
            if view.encoded is None and not view.ended and not _cleaned_up(view):
                return  # a record alone
            drone = self._drones[key] = _Drone()
            if len(self._drones) > TRACKED:
                del self._drones[next(iter(self._drones))]
        if not drone.started and (kind == _STARTED or view.state is DroneState.BUSY):
            drone.started = True
            self._payload_started(view)
        if kind == _FINISHED and self._payload_finished(view, drone):
            return
        if view.ended or view.state is DroneState.EXITING or _cleaned_up(view):
            self._ended(view, drone)

    def _payload_started(self, view: DroneView) -> None:
        site = self._site(view.site)
        if site.died:
            site.died = 0
            self._update(view.site, site, view)

    def _payload_ran_well(self, view: DroneView) -> None:
        site = self._site(view.site)
        site.ran_well = view.received_time
        if site.died or site.failing:
            site.died = site.failing = 0
            self._update(view.site, site, view)

    def _payload_finished(self, view: DroneView, drone: _Drone) -> bool:
        """Count one payload end; ``True`` if it made the drone a black hole"""
        event = view.event
        if not isinstance(event, PayloadFinished):
            return False
        end = (event.incarnation, event.seq)
        if drone.last_end == end:
            return False  # the same end told again (a record or a note changed)
        drone.last_end = end
        if _ran_well(event):
            drone.failures = 0
            self._payload_ran_well(view)
            return False
        if event.how in _NEUTRAL:
            return False
        drone.failures += 1
        if drone.failures < FAILED_PAYLOADS or not self._ran_well_elsewhere(view):
            return False
        self._decide(view, Verdict.FAILING)
        return True

    def _ran_well_elsewhere(self, view: DroneView) -> bool:
        now = view.received_time
        return now is not None and any(
            site.ran_well is not None and now - site.ran_well <= ELSEWHERE_S
            for name, site in self._sites.items()
            if name != view.site
        )

    def _ended(self, view: DroneView, drone: _Drone) -> None:
        event = view.event
        if drone.started or _asked(view, event):
            self._decide(view, None)
            return
        lifetime = _lifetime_s(event)
        self._decide(
            view, Verdict.DIED if lifetime is None or lifetime <= self.rules.lifetime_s else None
        )

    def _decide(self, view: DroneView, verdict: Verdict | None) -> None:
        key = view.key
        self._drones.pop(key, None)
        self._decided[key] = verdict
        if len(self._decided) > TRACKED:
            del self._decided[next(iter(self._decided))]
        if verdict is None:
            return
        site = self._site(view.site)
        site.counts[verdict] += 1
        site.last = view.drone
        if verdict is Verdict.DIED:
            site.died += 1
        else:
            site.failing += 1
        if self.tell:
            _lines.log(
                logging.INFO,
                f"black hole {view.site}",
                "drone %s/%s is a black hole: it %s",
                view.site,
                view.drone,
                self.rules.meaning(verdict),
                extra={"site": view.site, "drone": view.drone},
            )
        self._update(view.site, site, view)

    def _site(self, name: str) -> _Site:
        site = self._sites.get(name)
        if site is None:
            site = self._sites[name] = _Site()
        return site

    def _update(self, name: str, site: _Site, view: DroneView) -> None:
        """Flag the site, or clear its flag, by its runs of verdicts"""
        drones = self.rules.drones
        runs = [(site.died, Verdict.DIED), (site.failing, Verdict.FAILING)]
        count, verdict = max(runs, key=lambda run: run[0])
        flag = self.flags.get(name)
        if count >= drones:
            if flag is None:
                site.flags += 1
                number, since = site.flags, view.received_time or view.ended_time or 0.0
                if self.tell:
                    log.warning(
                        "site %s is a black hole: %d drones in a row %s (the last %s); the pool "
                        "asks for one probe drone after %.0fs, the wait doubling up to %.0fs, "
                        "until a drone of the site runs a payload",
                        name,
                        count,
                        self.rules.meaning(verdict, "their"),
                        site.last,
                        self.rules.backoff_s,
                        self.rules.backoff_max_s,
                        extra={"site": name, "drone": site.last},
                    )
            else:
                number, since = flag.number, flag.since
            self.flags = {**self.flags, name: Flag(verdict, count, site.last, since, number)}
        elif flag is not None:
            self.flags = {k: v for k, v in self.flags.items() if k != name}
            if self.tell:
                log.info(
                    "site %s is no black hole any more: drone %s runs payloads; the pool feeds it",
                    name,
                    view.drone,
                    extra={"site": name, "drone": view.drone},
                )

    # ------------------------------------------------------------------ the pool's side

    def allowance(self, site: str, now: float) -> int | None:
        """
        How many drones a pool of ``site`` that wants more may ask for now

        Call it only when the pool is short of its demand; a probe it is given counts as
        asked for. Called from the pool's thread only.

        :param now: the pool's monotonic clock, seconds
        :returns: ``None``: as many as it needs (not flagged); ``1``: one probe drone;
            ``0``: none yet
        """
        flag = self.flags.get(site)
        if flag is None:
            self._probes.pop(site, None)
            return None
        probes = self._probes.get(site)
        rules = self.rules
        if probes is None or probes.number != flag.number:
            probes = self._probes[site] = _Probes(
                flag.number, now + rules.backoff_s, rules.backoff_s
            )
        if now < probes.next_at:
            self.withheld[site] += 1
            return 0
        probes.period_s = min(probes.period_s * 2, rules.backoff_max_s)
        probes.next_at = now + probes.period_s
        self.probes[site] += 1
        return 1

    def next_probe_in(self, site: str, now: float) -> float | None:
        """Seconds until the flagged ``site`` may get its next probe drone (pool's clock)"""
        probes = self._probes.get(site)
        flag = self.flags.get(site)
        if probes is None or flag is None or probes.number != flag.number:
            return None
        return max(0.0, probes.next_at - now)


def _cleaned_up(view: DroneView) -> bool:
    """
    Whether TARDIS released the drone on its own (:data:`CLEANUP_NOTES`) before its agent
    spoke: it found the job failed or gone, and no agent can claim the drone any more.
    (The batch system may keep a failed job listed for minutes, Slurm's ``MinJobAge``, and
    TARDIS gives the drone up only when it is no longer listed.)
    """
    record = view.record
    return (
        view.encoded is None
        and record is not None
        and record.phase is RecordPhase.RELEASED
        and record.note in CLEANUP_NOTES
    )


def _ran_well(event: AnyEvent | None) -> bool:
    """Whether ``event`` is the end of a payload that ran well: a clean exit, or a long run"""
    if not isinstance(event, PayloadFinished):
        return False
    duration = event.duration_s
    if duration is not None and math.isfinite(duration) and duration >= FAST_FAILURE_S:
        return True
    return event.how is PayloadEnd.EXIT and event.exit_code == 0


def _asked(view: DroneView, event: AnyEvent | None) -> bool:
    """
    Whether someone asked the drone to end: a release, a drain intent (the manager's, an
    operator's or the agent's own: a notice), a drain deadline; not TARDIS removing, on its
    own, a job it found failed or gone (:data:`CLEANUP_NOTES`)
    """
    record = view.record
    if record is not None:
        cleanup = record.note in CLEANUP_NOTES or (
            record.drain is not None and record.drain.reason in CLEANUP_NOTES
        )
        if cleanup:
            return False
        if record.drain is not None or record.phase in _ASKED_PHASES:
            return True
    if view.ended in _ASKED_ENDS or view.state is DroneState.RELEASED:
        return True
    return event is not None and event.snapshot.drain is not None


def _lifetime_s(event: AnyEvent | None) -> float | None:
    """
    Seconds from the agent's start to its newest ``event``, by the agent's clock (a span on
    one clock); ``None`` if its agent never spoke
    """
    if event is None:
        return None
    return max(0.0, (event.at - event.snapshot.started_at).total_seconds())
