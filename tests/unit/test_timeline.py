"""cobald-remote timeline: events and TARDIS notes in one time order"""

from __future__ import annotations

import datetime as dt

import msgspec
from support.drones import FakeDrone

from broker.commands.timeline import format_timeline
from broker.manager.timeline import build, describe, end_row
from broker.manager.views import DroneView
from remote_agent.protocol import events as ev

T0 = dt.datetime(2026, 3, 18, 17, 27, 6, tzinfo=dt.UTC)


def _note(seconds: float, state: str, status: str) -> ev.TardisState:
    return ev.TardisState(
        site="site1",
        drone="site1-0000000001",
        state=state,
        resource_status=status,
        at=T0 + dt.timedelta(seconds=seconds),
        id=f"n{seconds}",
    )


def test_the_report_as_a_timeline() -> None:
    drone = FakeDrone("site1", "site1-0000000001", clock=T0 + dt.timedelta(seconds=30))
    started, ready, beat = drone.started(), drone.ready(), drone.heartbeat()
    payload = drone.payload_started("12.0")
    messages: list[tuple[int, ev.Message]] = [
        (5, payload),
        (1, _note(0, "BootingState", "Booting")),
        (2, started),
        (3, ready),
        (4, beat),
        (6, _note(60, "CleanupState", "Booting")),
    ]
    rows = build(messages)
    assert [r.drone_event or r.tardis_state for r in rows] == [
        "-> BootingState (Booting)",
        "agent_started on ?",
        "startd_ready: 4 slot(s)",
        "payload_started 12.0",
        "-> CleanupState (Booting)",
    ]
    # TARDIS's state is carried to the agent's rows: it still thought the drone was queued
    assert rows[3].tardis_state == "BootingState (Booting)"
    assert rows[3].drone_state == "busy"
    assert len(build(messages, heartbeats=True)) == 6
    table = format_timeline(rows).splitlines()
    assert table[0].split() == [
        "TIME",
        "(UTC)",
        "DRONE",
        "EVENT",
        "DRONE",
        "STATE",
        "TARDIS",
        "STATE",
    ]
    assert table[1].startswith("17:27:06.000")


def test_descriptions_say_what_matters() -> None:
    drone = FakeDrone("site1", "site1-0000000001")
    drone.payload_started("7.0")
    finished = drone.payload_finished("7.0")
    assert describe(finished) == "payload_finished 7.0 (exit)"
    assert describe(drone.exiting()) == "agent_exiting: exit 0"


def test_a_deadline_on_another_day_shows_its_date() -> None:
    drone = FakeDrone("site1", "site1-0000000001")
    at = dt.datetime(2026, 12, 1, 17, 57, 19, tzinfo=dt.UTC)
    today = drone._event(ev.Draining, payloads=2, deadline=at + dt.timedelta(minutes=10))
    tomorrow = drone._event(ev.Draining, payloads=2, deadline=at + dt.timedelta(days=1))
    today, tomorrow = (msgspec.structs.replace(e, at=at) for e in (today, tomorrow))
    assert describe(today) == "draining: 2 payload(s), deadline 18:07:19"
    assert describe(tomorrow) == "draining: 2 payload(s), deadline 2026-12-02 17:57:19"


def test_an_ended_drone_ends_with_the_managers_row() -> None:
    drone = FakeDrone("site1", "site1-0000000001", clock=T0)
    rows = build([(1, drone.started()), (2, _note(5, "DrainingState", "Running"))])
    live = DroneView(site="site1", drone="site1-0000000001")
    assert end_row(rows, live) is None and end_row(rows, None) is None
    ended = msgspec.structs.replace(live, ended="drained", ended_time=T0.timestamp() + 9)
    end = end_row(rows, ended)
    assert end is not None
    assert (end.drone_event, end.drone_state, end.tardis_state, end.source) == (
        "ended: drained",
        "starting",
        "DrainingState (Running)",
        "manager",
    )
    assert format_timeline([*rows, end]).splitlines()[-1].split() == [
        "17:27:15.000",
        "ended:",
        "drained",
        "starting",
        "DrainingState",
        "(Running)",
    ]
