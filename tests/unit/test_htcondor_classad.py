"""Long-form ClassAd reading (the agent's) and the emulator's own expression evaluator"""

from __future__ import annotations

import pytest

from broker.emulation.execution_point import classad as emu
from remote_agent.classad import Expr, parse_ad, parse_ads, parse_value, quote

JOB_AD = """\
ClusterId = 4711
ProcId = 3
Owner = "alice"
RemoteHost = "slot1_2@glidein_17@wn042.example.org"
Cmd = "/bin/sh"
Arguments = "-c \\"echo hi\\""
JobDuration = 12.5
ExitBySignal = false
Requirements = (TARGET.Arch == "X86_64") && (TARGET.OpSys == "LINUX")
NoValue = undefined
"""


def test_job_ad_values_are_typed() -> None:
    ad = parse_ad(JOB_AD)
    assert ad.integer("ClusterId") == 4711
    assert ad.integer("procid") == 3  # attribute names are case-insensitive
    assert ad.string("Owner") == "alice"
    assert ad.string("Arguments") == '-c "echo hi"'
    assert ad.real("JobDuration") == 12.5
    assert ad.boolean("ExitBySignal") is False
    assert isinstance(ad["Requirements"], Expr)
    assert ad.string("Requirements") is None  # an expression is not a string
    assert "NoValue" in ad and ad["NoValue"] is None


def test_garbage_lines_cost_only_themselves() -> None:
    ad = parse_ad("ClusterId = 1\n%%% not an ad line\n[\nProcId = 0\n]\n")
    assert (ad.integer("ClusterId"), ad.integer("ProcId")) == (1, 0)


def test_blank_lines_separate_ads() -> None:
    ads = parse_ads('Name = "slot1@h"\nState = "Claimed"\n\n\nName = "slot2@h"\n\n')
    assert [ad.string("Name") for ad in ads] == ["slot1@h", "slot2@h"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("TRUE", True),
        ("-17", -17),
        ("1.5e3", 1500.0),
        # old ClassAd syntax: backslashes are literal, \" is a quote inside
        ('"a\\\\b"', "a\\\\b"),
        ('"C:\\new\\t"', "C:\\new\\t"),
        ('"say \\"hi\\""', 'say "hi"'),
        ('"ends with \\"', "ends with \\"),
        ('"a" + "b"', Expr('"a" + "b"')),
        ("foo", Expr("foo")),
    ],
)
def test_values(text: str, value: object) -> None:
    assert parse_value(text) == value


def test_quote_round_trips_and_stays_on_one_line() -> None:
    text = 'drone "x" is draining \\ now\\'
    assert parse_value(quote(text)) == text
    # old syntax cannot carry a line break inside a string
    assert quote("two\nlines\r\nhere") == '"two lines here"'


def _eval(expr: str, **attrs: emu.Value) -> emu.Value:
    return emu.evaluate(expr, {name: emu.literal(value) for name, value in attrs.items()})


@pytest.mark.parametrize(
    ("expr", "attrs", "expected"),
    [
        ("(True) && (DroneGateOpen =?= True)", {}, False),  # undefined =?= True is false
        ("(True) && (DroneGateOpen =?= True)", {"DroneGateOpen": True}, True),
        ("DroneGateOpen == True", {}, emu.UNDEFINED),
        ("Undef && false", {}, False),
        ("Undef || true", {}, True),
        ("Undef && true", {}, emu.UNDEFINED),
        ('State =!= "Claimed"', {"State": "Unclaimed"}, True),
        ('State == "claimed"', {"State": "Claimed"}, True),  # == ignores case on strings
        ('State =?= "claimed"', {"State": "Claimed"}, False),  # =?= does not
        ("STARTD_StartTime =?= 0", {"STARTD_StartTime": 0}, True),
        ("ifThenElse(x > 2, 1, 2) + 3 * 2", {"x": 5}, 7),
        ("isUndefined(nope) ? 10000000 : 0", {}, 10000000),
        ("1 / 0", {}, emu.ERROR),
    ],
)
def test_emulator_evaluates_three_valued_logic(
    expr: str, attrs: dict[str, emu.Value], expected: emu.Value
) -> None:
    assert _eval(expr, **attrs) == expected


def test_emulator_ad_prints_sorted_long_form() -> None:
    ad = emu.Ad()
    ad.set("Name", 'slot1@"h"')
    ad.set("Activity", "Busy")
    ad.set_expr("Start", "(True) && (DroneGateOpen =?= True)")
    ad.set("Cpus", 1)
    assert ad.long() == (
        'Activity = "Busy"\nCpus = 1\nName = "slot1@\\"h\\""\n'
        "Start = (True) && (DroneGateOpen =?= True)\n"
    )
    # the agent's reader understands what the emulator prints
    assert parse_ad(ad.long()).string("Name") == 'slot1@"h"'


def test_emulator_rejects_unsupported_syntax() -> None:
    with pytest.raises(emu.ClassAdSyntaxError):
        emu.parse("a = = b")
    with pytest.raises(emu.ClassAdSyntaxError):
        emu.Ad.from_long("not an assignment\n")
