"""
The black-hole detector on hand-fed registry events: which drones are black holes, when a
site is flagged and cleared, and the probes a flagged site gets
"""

from __future__ import annotations

import datetime as dt
import logging

import pytest
from support.drones import FakeDrone
from support.registry import NS, PROOF_KEY

from broker.manager import blackholes
from broker.manager.blackholes import FAILED_PAYLOADS, BlackHoles, Rules, Verdict
from broker.manager.lifecycle import TARDIS_DOWN
from broker.manager.registry import Applied, Registry
from remote_agent.protocol import events as ev
from remote_agent.protocol.names import MSG_ID
from remote_agent.protocol.proof import record_proof
from remote_agent.protocol.ratelog import RateLimitedLog

SITE = "site1"
OTHER = "site2"


@pytest.fixture(autouse=True)
def _every_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No line held back by another test's"""
    monkeypatch.setattr(blackholes, "_lines", RateLimitedLog(blackholes.log, interval_s=0.0))


class Fleet:
    """A registry with the detector watching it, fed as the consumer and the KV watch feed it"""

    def __init__(self, rules: Rules | None = None) -> None:
        self.registry = Registry(NS)
        self.registry.proof_key = PROOF_KEY
        self.detector = BlackHoles(rules)
        self.registry.watchers.append(self.detector.seen)
        self.time = 1000.0
        self.seq = 0
        self.revisions: dict[str, int] = {}
        self.made = 0

    def drone(self, site: str = SITE) -> FakeDrone:
        self.made += 1
        return FakeDrone(site, f"{site}-{self.made:010x}")

    def tick(self) -> float:
        self.time += 1.0
        self.seq += 1
        return self.time

    def event(self, event: ev.Event) -> None:
        subject = NS.event(event.site, event.drone, ev.kind_of(type(event)))
        at = self.tick()
        applied = self.registry.apply_message(
            ev.encode(event), subject, at, self.seq, {MSG_ID: event.id}
        )
        assert applied is Applied.APPLIED
        self.registry.mark_ended(at)

    def record(
        self,
        drone: FakeDrone,
        phase: ev.RecordPhase,
        writer: str = "agent",
        drain: ev.DrainIntent | None = None,
        note: str = "",
    ) -> None:
        record = ev.DroneRecord(
            site=drone.site,
            drone=drone.drone,
            phase=phase,
            writer=writer,  # type: ignore[arg-type]
            drain=drain,
            at=ev.utcnow(),
            note=note,
        )
        if writer == "manager":
            record = ev.DroneRecord(
                **{f: getattr(record, f) for f in record.__struct_fields__ if f != "proof"},
                proof=record_proof(PROOF_KEY, record),
            )
        revision = self.revisions[drone.drone] = self.revisions.get(drone.drone, 0) + 1
        at = self.tick()
        assert self.registry.apply_record(record, revision, at) is Applied.APPLIED
        self.registry.mark_ended(at)

    def down(self, site: str, drone: str) -> None:
        """TARDIS's note that the batch system reported the drone's job gone"""
        at = self.tick()
        note = ev.TardisState(
            site=site,
            drone=drone,
            state=TARDIS_DOWN,
            at=dt.datetime.fromtimestamp(at, dt.UTC),
            id=f"n{self.seq}",
        )
        subject = NS.manager_note(site, drone, "tardis_state")
        applied = self.registry.apply_note_message(
            ev.encode(note), subject, at, self.seq, {MSG_ID: note.id}
        )
        assert applied is Applied.APPLIED
        self.registry.mark_ended(at)

    # a drone's whole life, as its agent tells it
    def dies_at_once(self, site: str = SITE) -> FakeDrone:
        """The worker exits seconds after the agent started it; no payload, nobody asked"""
        drone = self.drone(site)
        self.event(drone.started())
        self.event(drone.worker_up())
        self.event(drone.worker_exited(1))
        self.event(drone.exiting())
        return drone

    def runs_a_payload(self, site: str = SITE) -> FakeDrone:
        drone = self.drone(site)
        self.event(drone.started())
        self.record(drone, ev.RecordPhase.UP)
        self.event(drone.gate_opened())
        self.event(drone.payload_started("1.0"))
        return drone

    def fails_payloads(self, site: str = SITE, count: int = FAILED_PAYLOADS) -> FakeDrone:
        """Each payload is held seconds after it started: the site's environment is broken"""
        drone = self.drone(site)
        self.event(drone.started())
        self.record(drone, ev.RecordPhase.UP)
        self.event(drone.gate_opened())
        for i in range(count):
            self.event(drone.payload_started(f"{i}.0"))
            self.event(drone.payload_finished(f"{i}.0", ev.PayloadEnd.HOLD, None, 2.0))
        return drone

    def verdicts(self, site: str = SITE) -> dict[str, int]:
        return self.detector.counts().get(site, {})


def _intent(reason: str = "chosen for release: no payload runs") -> ev.DrainIntent:
    now = ev.utcnow()
    return ev.DrainIntent(
        deadline=now + dt.timedelta(hours=1), reason=reason, requested_at=now, request_id="r1"
    )


def test_drones_that_die_at_once_flag_their_site_after_three_in_a_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = Fleet()
    caplog.set_level(logging.INFO, "cobald.runtime.cobald_remote.registry")
    first = fleet.dies_at_once()
    assert fleet.detector.verdict(SITE, first.drone) is Verdict.DIED
    fleet.dies_at_once()
    assert SITE not in fleet.detector.flags
    last = fleet.dies_at_once()
    flag = fleet.detector.flags[SITE]
    assert (flag.verdict, flag.drones, flag.last) == (Verdict.DIED, 3, last.drone)
    assert fleet.verdicts() == {"died": 3}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"site {SITE} is a black hole: 3 drones in a row ended unasked, without a payload, "
        f"within 600s of their agent's start (the last {last.drone}); the pool asks for one "
        "probe drone after 300s, the wait doubling up to 3600s, until a drone of the site "
        "runs a payload"
    ]
    assert f"drone {SITE}/{first.drone} is a black hole" in caplog.text
    # another site is not touched
    assert fleet.detector.allowance(OTHER, 0.0) is None


def test_a_drone_whose_job_ends_before_its_agent_speaks_is_a_black_hole() -> None:
    """TARDIS's note alone: the batch system reported the job gone, nobody released it"""
    fleet = Fleet()
    for i in range(3):
        fleet.down(SITE, f"{SITE}-{i:010x}")
    assert fleet.detector.flags[SITE].drones == 3
    assert fleet.verdicts() == {"died": 3}


def test_tardis_removing_a_failed_job_on_its_own_asked_the_drone_nothing() -> None:
    """TARDIS saw the job fail and removes it: the release is its cleanup, not a request"""
    fleet = Fleet()
    for action in ("terminate", "stop", "terminate"):
        drone = fleet.drone()
        note = blackholes.cleanup_note(action)
        fleet.record(drone, ev.RecordPhase.RELEASED, writer="manager", note=note)
        # judged at TARDIS's release: the job may stay listed at the site for minutes
        assert fleet.detector.verdict(SITE, drone.drone) is Verdict.DIED
        fleet.down(SITE, drone.drone)
    assert fleet.detector.flags[SITE].drones == 3
    assert fleet.verdicts() == {"died": 3}


def test_drones_ended_by_request_or_after_their_lifetime_are_no_black_holes() -> None:
    fleet = Fleet()
    # released before it came up (COBalD's demand fell): the manager's record, then gone
    queued = fleet.drone()
    reason = "chosen for release: its agent never announced itself (queued 5s)"
    fleet.record(queued, ev.RecordPhase.RELEASED, writer="manager", note=reason)
    fleet.down(SITE, queued.drone)
    # came up, ran nothing, drained idle by TARDIS: the manager's drain intent in the record
    idle = fleet.drone()
    fleet.event(idle.started())
    fleet.record(idle, ev.RecordPhase.UP)
    fleet.event(idle.gate_opened())
    fleet.record(idle, ev.RecordPhase.DRAINING, writer="manager", drain=_intent())
    fleet.event(idle.drained())
    fleet.record(idle, ev.RecordPhase.DRAINED, drain=_intent())
    fleet.event(idle.exiting())
    # drained on its own notice (the agent's own intent, e.g. a preemption notice)
    noticed = fleet.drone()
    fleet.event(noticed.started())
    noticed.drain = _intent("preemption notice")
    fleet.event(noticed.drained())
    fleet.event(noticed.exiting())
    # the batch system's SIGTERM at its walltime, hours after the agent started
    walltime = fleet.drone()
    fleet.event(walltime.started())
    fleet.event(walltime.gate_opened())
    walltime.clock += dt.timedelta(hours=2)
    fleet.event(walltime.worker_exited(143))
    fleet.event(walltime.exiting())
    # ran a payload, then its worker died
    busy = fleet.runs_a_payload()
    fleet.event(busy.worker_exited(1))
    fleet.event(busy.exiting())
    ended = [v for v in fleet.registry.views().values() if v.ended or v.kind == "agent_exiting"]
    assert len(ended) == 5
    assert fleet.verdicts() == {}
    assert all(fleet.detector.verdict(SITE, v.drone) is None for v in ended)
    assert fleet.detector.flags == {}


def test_a_payload_started_at_the_site_ends_a_run_and_clears_the_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = Fleet()
    fleet.dies_at_once()
    fleet.dies_at_once()
    fleet.runs_a_payload()  # none that ran payloads in between: the run starts over
    fleet.dies_at_once()
    fleet.dies_at_once()
    assert fleet.detector.flags == {}
    fleet.dies_at_once()
    assert SITE in fleet.detector.flags
    caplog.set_level(logging.INFO, "cobald.runtime.cobald_remote.registry")
    probe = fleet.runs_a_payload()
    assert fleet.detector.flags == {}
    assert (
        f"site {SITE} is no black hole any more: drone {probe.drone} runs payloads" in caplog.text
    )


def test_a_flag_counts_each_drone_once_however_often_the_registry_shows_it() -> None:
    fleet = Fleet()
    drone = fleet.dies_at_once()
    view = fleet.registry.view(SITE, drone.drone)
    assert view is not None
    for _ in range(5):  # a record, a note, a rebuild: the same end told again
        fleet.detector.seen(view)
    fleet.record(drone, ev.RecordPhase.DRAINED)
    fleet.down(SITE, drone.drone)
    assert fleet.verdicts() == {"died": 1}
    assert fleet.detector.flags == {}


def test_payloads_that_fail_at_once_flag_a_site_only_while_payloads_run_well_elsewhere() -> None:
    fleet = Fleet()
    # every site's payloads fail alike: a user's broken jobs, not a site
    for site in (SITE, OTHER, SITE, OTHER, SITE):
        fleet.fails_payloads(site)
    assert fleet.detector.counts() == {}
    assert fleet.detector.flags == {}
    # payloads run well on the other site
    good = fleet.runs_a_payload(OTHER)
    fleet.event(good.payload_finished("1.0", ev.PayloadEnd.EXIT, 0, 3600.0))
    drones = [fleet.fails_payloads(SITE) for _ in range(3)]
    assert [fleet.detector.verdict(SITE, d.drone) for d in drones] == [Verdict.FAILING] * 3
    flag = fleet.detector.flags[SITE]
    assert (flag.verdict, flag.drones) == (Verdict.FAILING, 3)
    # a payload that starts proves nothing of payloads that fail: the flag stays
    starting = fleet.runs_a_payload(SITE)
    assert SITE in fleet.detector.flags
    # one that ran well clears it
    fleet.event(starting.payload_finished("1.0", ev.PayloadEnd.EXIT, 0, 10.0))
    assert fleet.detector.flags == {}


def test_payload_ends_that_say_nothing_of_the_site_do_not_count() -> None:
    fleet = Fleet()
    good = fleet.runs_a_payload(OTHER)
    fleet.event(good.payload_finished("1.0", ev.PayloadEnd.EXIT, 0, 5.0))
    drone = fleet.runs_a_payload(SITE)
    for i in range(2 * FAILED_PAYLOADS):  # removed by their owners, evicted by a drain
        how = ev.PayloadEnd.REMOVE if i % 2 else ev.PayloadEnd.EVICT
        fleet.event(drone.payload_started(f"{i}.1"))
        fleet.event(drone.payload_finished(f"{i}.1", how, None, 1.0))
    for i in range(FAILED_PAYLOADS - 1):  # fast failures, but one short of a run
        fleet.event(drone.payload_started(f"{i}.2"))
        fleet.event(drone.payload_finished(f"{i}.2", ev.PayloadEnd.EXIT, 1, 1.0))
    fleet.event(drone.payload_started("9.3"))  # a failure after a long run ran well
    fleet.event(drone.payload_finished("9.3", ev.PayloadEnd.EXIT, 1, 600.0))
    assert fleet.detector.verdict(SITE, drone.drone) is None
    assert fleet.detector.counts().get(SITE, {}) == {}


def test_a_flagged_site_gets_one_probe_per_backoff_period_doubling_up_to_the_cap() -> None:
    fleet = Fleet(Rules(drones=1, backoff_s=10.0, backoff_max_s=35.0))
    detector = fleet.detector
    assert detector.allowance(SITE, 0.0) is None  # not flagged: as many as it needs
    fleet.dies_at_once()
    assert detector.allowance(SITE, 100.0) == 0  # flagged now: the first probe after 10 s
    assert detector.next_probe_in(SITE, 100.0) == 10.0
    probes = [t for t in range(100, 300) if detector.allowance(SITE, float(t))]
    assert probes == [110, 130, 165, 200, 235, 270]  # 10, 20, 35 (the cap), 35, ...
    assert detector.probes[SITE] == len(probes)
    assert detector.withheld[SITE] == 200 - len(probes) + 1
    # a payload clears the flag; a new flag starts over at the first period
    fleet.runs_a_payload()
    assert detector.allowance(SITE, 300.0) is None
    fleet.dies_at_once()
    assert detector.allowance(SITE, 400.0) == 0
    assert detector.allowance(SITE, 410.0) == 1


def test_an_agent_clock_that_lies_changes_only_its_own_verdict() -> None:
    """The lifetime is a span on the agent's clock: a clock a day off is still seconds"""
    fleet = Fleet()
    for offset in (dt.timedelta(days=1), -dt.timedelta(days=3650), dt.timedelta(0)):
        drone = fleet.drone()
        drone.clock = drone.started_at = drone.clock + offset
        fleet.event(drone.started())
        fleet.event(drone.exiting())
    assert fleet.verdicts() == {"died": 3}


def test_off_when_no_drones_flag_a_site() -> None:
    fleet = Fleet(Rules(drones=0))
    for _ in range(5):
        fleet.dies_at_once()
    assert fleet.detector.counts() == {}
    assert fleet.detector.allowance(SITE, 0.0) is None
