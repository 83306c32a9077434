"""
The end of a drone's life: when the registry calls a drone ended, and when it retires it

Its rule (:func:`ended_by`, :func:`forgotten_at`) is a function of the drone's view alone,
and every time in it is a stream or bucket time, so a rebuilt registry ends and forgets the
same drones at the same times. :class:`EndTracker` keeps the work per tick proportional to
the views that changed.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable, MutableMapping
from typing import Final

import msgspec

from broker.manager.schedule import Schedule
from broker.manager.views import DroneView, iso_time
from remote_agent.protocol.events import DroneState, RecordPhase
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.registry")
#: the operator's lines: each drone's own, at most one a minute per drone and kind, so
#: every drone's life is told whatever the fleet does and no drone can flood the log
lines = RateLimitedLog(log, interval_s=60.0)

#: TARDIS's state of a drone it has given up: the batch system reported its job gone.
#: The note carries ``str(state)``, the class name (tardis ``interfaces/state.py:15``,
#: ``resources/dronestates.py:329``).
TARDIS_DOWN: Final = "DownState"
#: default seconds an ended drone is kept before it is retired (dropped, its record purged)
DEFAULT_RETAIN_ENDED_S: Final = 86400.0
#: default seconds a drone neither ended nor heard of is kept before it is retired
DEFAULT_RETAIN_LOST_S: Final = 7 * 86400.0


def least_retain_lost_s(lost_after_s: float, lost_removal_after_s: float = 0.0) -> float:
    """
    The shortest ``retain_lost_s`` other than ``0`` (never): the one retention rule

    No drone that speaks is offered for retirement between two signs of life
    (``lost_after_s``), and none before TARDIS may remove its batch job
    (``lost_removal_after_s``, where TARDIS removes lost drones).
    """
    return max(lost_after_s, lost_removal_after_s)


def check_retain_lost(retain_lost_s: float, lost_after_s: float) -> None:
    """
    :raises ValueError: unless ``retain_lost_s`` is ``0`` or finite and at least
        :func:`least_retain_lost_s`
    """
    least = least_retain_lost_s(lost_after_s)
    if not (retain_lost_s == 0 or least <= retain_lost_s < math.inf):
        raise ValueError(
            f"retain_lost_s must be 0 (never) or at least lost_after_s ({least:g} s), "
            f"not {retain_lost_s!r}"
        )


class Ending(enum.StrEnum):
    """Why a drone's life ended (:attr:`DroneView.ended`)"""

    DRAINED = "drained"  #: its record is drained and its agent exited or fell silent
    RELEASED = "released"  #: released by the manager, and its agent said it is exiting
    DEADLINE_EXPIRED = "deadline_expired"  #: its drain deadline expired, and its agent exited
    REMOVED = "removed"  #: TARDIS gave it up after its batch job was gone


def _agent_final(view: DroneView) -> bool:
    return view.state is DroneState.EXITING


def ended_by(view: DroneView, lost_after_s: float) -> tuple[Ending, float] | float | None:
    """
    Why and since when the drone of ``view`` has ended; else when it will by silence

    A drone has ended when nothing newer came from its agent than:

    - a drained record (the agent's, or proven) and an ``exiting`` event, or
      ``lost_after_s`` of silence after it;
    - a released record (proven) or a deadline-expired record (the agent's), and an
      ``exiting`` event. A released drone whose agent never spoke has not ended by
      silence: its job may still be queued, and could start after its record is gone;
    - TARDIS's note that it is down (:data:`TARDIS_DOWN`), unless the drone's own end
      came first: then that is why it ended.

    :returns: ``(why, when)`` if it has ended; the time at which silence will end it
        (a drained drone not heard from since); ``None`` if neither
    """
    own = _own_end(view, lost_after_s)
    if view.tardis_state == TARDIS_DOWN and view.tardis_time is not None:
        if isinstance(own, tuple) and own[1] <= view.tardis_time:
            return own
        return Ending.REMOVED, view.tardis_time
    return own


def _own_end(view: DroneView, lost_after_s: float) -> tuple[Ending, float] | float | None:
    """:func:`ended_by` from the record and the agent's events alone"""
    record = view.record
    if record is None or record.phase is None:
        return None
    phase = record.phase
    exited = _agent_final(view) and view.received_time is not None
    # an exited drone ended with the later of its exit and its record
    when = max(view.received_time or 0.0, record.stored or record.at)
    if phase is RecordPhase.DRAINED and (record.writer == "agent" or record.proven):
        if exited:
            return Ending.DRAINED, when
        since = view.last_seen or record.stored or record.at
        return since + lost_after_s
    if not exited:
        return None
    if phase is RecordPhase.RELEASED and record.proven:
        return Ending.RELEASED, when
    if phase is RecordPhase.DEADLINE_EXPIRED and record.writer == "agent":
        return Ending.DEADLINE_EXPIRED, when
    return None


def quiet_since(view: DroneView) -> float | None:
    """
    When the newest fact about the drone was stored: its agent's newest event or heartbeat,
    its record, TARDIS's newest note; ``None`` if none is known

    Stream and bucket times only: a time a drone wrote (an event's ``at``, a record's)
    counts for nothing, so no drone moves this for itself or for another.
    """
    record = view.record
    times = (
        view.received_time,
        view.heartbeat_time,
        view.tardis_time,
        record.stored if record is not None else None,
    )
    return max((at for at in times if at is not None), default=None)


def forgotten_at(view: DroneView, retain_lost_s: float) -> float | None:
    """
    When the drone of ``view``, not ended, is retired for silence: ``retain_lost_s`` after
    the newest fact about it (:func:`quiet_since`); ``None``: not by silence

    That covers a lost drone and a drone whose agent never spoke (a forced release), and
    never comes before the deadline of a drain its record holds (TARDIS may remove a lost
    drone only after it). An ended drone retires ``retain_ended_s`` after its end instead;
    a record the KV watch has not confirmed yet is a fact of this moment, whose time comes
    with it.
    """
    record = view.record
    if not retain_lost_s or view.ended or (record is not None and record.stored is None):
        return None
    since = quiet_since(view)
    if since is None:
        return None
    if record is not None and record.drain_due is not None:
        return max(since + retain_lost_s, record.drain_due)
    return since + retain_lost_s


def _iso(at: float | None) -> str:
    return "?" if at is None else iso_time(at)


def _extra(view: DroneView) -> dict[str, str]:
    return {"site": view.site, "drone": view.drone}


def _kind(kind: str, view: DroneView) -> str:
    """The rate limit's kind of one operator line: the drone's own"""
    return f"{kind} {view.site}/{view.drone}"


class EndTracker:
    """
    Which views to look at when: those changed since the last tick, drained drones whose
    silence is due, drones whose silence reaches ``lost_after_s``, ended drones whose
    retention is over, and drones silent for ``retain_lost_s`` (``0``: never)

    Each tick looks at these alone, never at every view: its cost follows what changed
    and what fell due, not the size of the fleet.

    :param views: the registry's views, changed in place
    """

    def __init__(
        self,
        views: MutableMapping[tuple[str, str], DroneView],
        lost_after_s: float,
        retain_ended_s: float,
        retain_lost_s: float = DEFAULT_RETAIN_LOST_S,
    ) -> None:
        self._views = views
        self.lost_after_s = lost_after_s
        self.retain_ended_s = retain_ended_s
        self.retain_lost_s = retain_lost_s
        self._changed: set[tuple[str, str]] = set()
        self._silence = Schedule()
        self._retire = Schedule()
        self._forget = Schedule()
        #: when each drone not lost and not ended is due to be lost (it moves later with
        #: every sign of life: looked at then, and held again at its new time)
        self._lost = Schedule()
        #: lost drones whose view changed, for the next :meth:`mark_lost`
        self._relost: set[tuple[str, str]] = set()
        #: the very views :meth:`due` offered for retirement by silence
        self._forgotten: dict[tuple[str, str], DroneView] = {}
        #: drones that started a payload since their agent started (for one line each)
        self._served: set[tuple[str, str]] = set()
        #: a rebuild replays what the operator's lines told before a restart: no lines then
        self.quiet = False

    @property
    def pending(self) -> int:
        """Views changed since the last :meth:`mark_ended` (what the next one looks at)"""
        return len(self._changed)

    def changed(self, key: tuple[str, str]) -> None:
        """The view of ``key`` was replaced (cheap: called for every applied message)"""
        self._changed.add(key)

    def mark_ended(self, now: float) -> list[DroneView]:
        """
        Derive :attr:`DroneView.ended` for every view that changed or fell silent

        An ended drone is never lost. :returns: the views that ended with this call
        """
        keys = self._changed
        self._changed = set()
        while (due := self._silence.pop_due(now)) is not None:
            keys.add(due)
        newly = []
        for key in keys:
            view = self._views.get(key)
            if view is None:
                continue
            self._forgotten.pop(key, None)  # changed since it was offered
            if self._derive(key, view, now):
                newly.append(self._views[key])
            at = forgotten_at(self._views[key], self.retain_lost_s)
            if at is not None:
                self._forget.add(key, at)
            self._lost_at(key, self._views[key])
        return newly

    def _derive(self, key: tuple[str, str], view: DroneView, now: float) -> bool:
        found = ended_by(view, self.lost_after_s)
        if isinstance(found, float):
            if found > now:
                self._silence.add(key, found)
                found = None
            else:
                found = (Ending.DRAINED, found)
        why, when = found if found is not None else ("", None)
        if (why, when) == (view.ended, view.ended_time):
            return False
        self._views[key] = msgspec.structs.replace(
            view, ended=str(why), ended_time=when, lost=view.lost and not why
        )
        if not why:
            if not self.quiet:
                lines.log(
                    logging.INFO,
                    _kind("back", view),
                    "drone %s/%s is back after its end (%s)",
                    view.site,
                    view.drone,
                    view.ended,
                    extra=_extra(view),
                )
            return False
        assert when is not None
        self._retire.add(key, when + self.retain_ended_s)
        if not view.ended and not self.quiet:
            lines.log(
                logging.INFO,
                _kind("ended", view),
                "drone %s/%s ended: %s",
                view.site,
                view.drone,
                why,
                extra=_extra(view),
            )
        return not view.ended

    def mark_lost(self, now: float) -> list[DroneView]:
        """
        Mark every drone silent for ``lost_after_s`` and not ended as lost, and a lost one
        that spoke again as not lost: the views changed since the last :meth:`mark_ended`
        or this call, and those whose silence fell due (never a scan of every view)
        """
        newly: list[DroneView] = []
        limit = self.lost_after_s
        keys = set(self._changed)
        keys.update(self._relost)
        self._relost = set()
        while (due := self._lost.pop_due(now)) is not None:
            keys.add(due)
        for key in keys:
            view = self._views.get(key)
            if view is None:
                continue
            lost = view.counts_lost(now, limit)
            if lost != view.lost:
                view = msgspec.structs.replace(view, lost=lost)
                self._views[key] = view
                if lost:
                    newly.append(view)
                    log.warning(
                        "drone %s/%s lost: no sign of life for %.0fs",
                        view.site,
                        view.drone,
                        now - (view.last_seen or now),
                        extra=_extra(view),
                    )
            if not view.lost:
                self._lost_at(key, view)
        return newly

    def _lost_at(self, key: tuple[str, str], view: DroneView) -> None:
        """
        Hold ``key`` for :meth:`mark_lost` until its silence reaches ``lost_after_s``;
        a lost drone's changed view is looked at by the next one (it may have spoken)
        """
        seen = view.last_seen
        if view.lost:
            self._relost.add(key)
        elif seen is not None and not view.ended:
            self._lost.add(key, seen + self.lost_after_s)

    def due(self, now: float, limit: int) -> list[DroneView]:
        """
        Up to ``limit`` views to retire at ``now``: ended ones whose retention is over,
        then those silent for ``retain_lost_s`` (each oldest first)
        """
        found: dict[tuple[str, str], DroneView] = {}
        while len(found) < limit and (key := self._retire.pop_due(now)) is not None:
            view = self._views.get(key)
            if view is None or not view.ended or view.ended_time is None:
                continue  # spoke after its end, or retired already
            at = view.ended_time + self.retain_ended_s
            if at <= now:
                found[key] = view
            else:
                self._retire.add(key, at)  # its end moved later since it was scheduled
        self._due_silent(now, limit, found)
        return list(found.values())

    def _due_silent(self, now: float, limit: int, found: dict[tuple[str, str], DroneView]) -> None:
        """Add to ``found`` the views not ended that nothing came of for ``retain_lost_s``"""
        while len(found) < limit and (key := self._forget.pop_due(now)) is not None:
            view = self._views.get(key)
            if view is None or key in found:
                continue
            forget = forgotten_at(view, self.retain_lost_s)
            if forget is None:
                continue  # ended (retired on its own schedule), or a fact without a time yet
            if forget <= now:
                found[key] = self._forgotten[key] = view
            else:
                self._forget.add(key, forget)  # heard of since it was scheduled

    def forgotten(self, view: DroneView) -> bool:
        """Whether :meth:`due` offered this very view for retirement by silence"""
        return self._forgotten.get(view.key) is view

    def later(self, view: DroneView, at: float) -> None:
        """Look at ``view`` for retirement again at ``at`` (its purge failed for now)"""
        (self._retire if view.ended else self._forget).add(view.key, at)

    def dropped(self, view: DroneView) -> None:
        """``view`` was retired: forget its drone here too, saying why if it had not ended"""
        key = view.key
        self._changed.discard(key)
        self._silence.discard(key)
        self._retire.discard(key)
        self._forget.discard(key)
        self._lost.discard(key)
        self._relost.discard(key)
        self._served.discard(key)
        if self._forgotten.pop(key, None) is None or view.ended:
            return
        since = quiet_since(view)
        lines.log(
            logging.INFO,
            _kind("retired", view),
            "drone %s/%s retired without an end: %s, and nothing came of it since %s "
            "(bus.retain_lost_s %.0fs)",
            view.site,
            view.drone,
            "lost" if view.last_seen is not None else "its agent never spoke",
            _iso(since),
            self.retain_lost_s,
            extra=_extra(view),
        )

    def rescan(self, keys: Iterable[tuple[str, str]]) -> None:
        """Look at every one of ``keys`` on the next tick (after a rebuild)"""
        self._changed.update(keys)

    def noted(self, old: DroneView | None, new: DroneView) -> None:
        """
        The operator's lines for one view replaced by another (rate-limited per drone);
        none while :attr:`quiet`
        """
        fresh = old is None or old.seq != new.seq  # a new event, not a new record
        first = old is None or old.encoded is None
        restarted = fresh and new.kind == "agent_started"
        if self.quiet:
            if restarted:
                self._served.discard(new.key)
            elif new.state is DroneState.BUSY:
                self._served.add(new.key)
            return
        if new.encoded is not None and (first or restarted):
            lines.log(
                logging.INFO,
                _kind("announced", new),
                "drone %s/%s announced itself (%s, %s)",
                new.site,
                new.drone,
                new.kind,
                new.state,
                extra=_extra(new),
            )
        if restarted:
            self._served.discard(new.key)  # a new incarnation: its first payload is to come
        elif new.state is DroneState.BUSY and new.key not in self._served:
            self._served.add(new.key)
            lines.log(
                logging.INFO,
                _kind("payload", new),
                "drone %s/%s started its first payload",
                new.site,
                new.drone,
                extra=_extra(new),
            )
        if old is not None and old.ended and not new.ended and fresh:
            lines.log(
                logging.INFO,
                _kind("spoke", new),
                "drone %s/%s spoke after its end (%s): %s",
                new.site,
                new.drone,
                old.ended,
                new.kind,
                extra=_extra(new),
            )
        phase = new.phase
        if phase is not (old.phase if old is not None else None) and phase in (
            RecordPhase.RELEASED,
            RecordPhase.DRAINING,
        ):
            lines.log(
                logging.INFO,
                _kind(str(phase), new),
                "drone %s/%s %s (record by the %s)",
                new.site,
                new.drone,
                "released" if phase is RecordPhase.RELEASED else "draining",
                new.record.writer if new.record is not None else "?",
                extra=_extra(new),
            )
