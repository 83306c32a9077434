"""The failure lines of the decorators stay bounded when a whole fleet fails, and count exactly"""

import logging

import pytest
from support.clock import FakeClock

from broker.tardis.failures import DRONE_LINES, CallLog

LOG = "test.calllog"
FLEET = 5_000


def _drone(number: int) -> str:
    return f"site1-{number:010d}"


def test_an_outage_of_the_whole_fleet_writes_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, LOG)
    clock = FakeClock()
    log = CallLog(logging.getLogger(LOG), 300.0, clock)
    down = OSError("condor_q: connection refused")
    per_heartbeat: list[int] = []
    for heartbeat in range(11):  # every 60 s for 10 minutes: 55,000 failures
        clock.now = 60.0 * heartbeat
        before = len(caplog.records)
        for number in range(FLEET):
            log.failed("resource_status", _drone(number), down)
        if heartbeat == 2:  # another cause of one drone is news at once
            assert log.failed("resource_status", _drone(4321), TimeoutError("condor_q: 30 s"))
        per_heartbeat.append(len(caplog.records) - before)
    lines = [record.getMessage() for record in caplog.records]
    assert per_heartbeat == [DRONE_LINES, 0, 1, 0, 0, 1 + DRONE_LINES, 0, 0, 0, 0, 1 + DRONE_LINES]
    then = "TARDIS asks again next heartbeat"
    assert lines[0] == (
        f"resource_status of {_drone(0)} failed: OSError: condor_q: connection refused; {then}"
    )
    assert lines[DRONE_LINES] == (
        f"resource_status of {_drone(4321)} failed: TimeoutError: condor_q: 30 s; {then}"
    )
    held = FLEET - DRONE_LINES
    assert lines[DRONE_LINES + 1] == (
        f"resource_status failed for {held} more drones in the last 300s ({held} failures): "
        f"OSError, the last {_drone(FLEET - 1)}: condor_q: connection refused; {then}"
    )
    assert lines[DRONE_LINES + 2].endswith(
        "refused; " + then + " (and 4 more like it in the last 300s)"
    )
    assert lines[-DRONE_LINES - 1].startswith(
        f"resource_status failed for {held} more drones in the last 300s ({5 * held} failures)"
    )
    # a drone that recovers and fails again later is logged again, with its own line
    clock.now = 2_000.0
    assert log.failed("resource_status", _drone(4000), down)
    summary, again = (record.getMessage() for record in caplog.records[-2:])
    assert summary.startswith(f"resource_status failed for {held} more drones in the last 1400s")
    assert again == lines[0].replace(_drone(0), _drone(4000))  # its failures were summed up


def test_every_failure_is_in_exactly_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOG)
    clock = FakeClock()
    log = CallLog(logging.getLogger(LOG), 300.0, clock, drone_lines=3)
    failures = 0
    for heartbeat in range(20):
        clock.now = 45.0 * heartbeat
        for number in range(heartbeat * 7 % 50 + 1):  # a fleet that fails in changing numbers
            log.failed("stop_resource", _drone(number), RuntimeError("condor_suspend: exit 1"))
            failures += 1
    clock.now += 300.0
    for number in range(50):  # every drone's held failures come due...
        log.failed("stop_resource", _drone(number), RuntimeError("condor_suspend: exit 1"))
        failures += 1
    clock.now += 300.0
    log.failed("stop_resource", _drone(99), RuntimeError("condor_suspend: exit 1"))  # ...and out
    failures += 1
    said = 0
    for record in caplog.records:
        message = record.getMessage()
        if " more drones " in message:
            said += int(message.split(" (", 1)[1].split(" failures)", 1)[0])
        else:
            more = message.partition("(and ")[2]
            said += 1 + (int(more.split()[0]) if more else 0)
    assert said == failures
