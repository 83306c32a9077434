"""
Our HTCondor seam checked against HTCondor's own code

The ``htcondor`` wheel (PyPI) carries HTCondor's ClassAd library and its
configuration reader, though no daemons. With it these tests check, without
an HTCondor installation:

- that HTCondor reads ``deploy/htcondor/cobald-remote-drone.conf`` as we
  intend (START gate, hooks, master shutdown), and that the emulator's config
  reader and ClassAd evaluator agree with HTCondor's on it;
- that the agent reads every ``Attr = value`` line exactly as HTCondor reads
  it (the job ad on a hook's stdin, ``condor_who``/``condor_status -long``),
  and that HTCondor reads the lines a hook prints back as the hook meant them;
- that what the emulated ``condor_*`` tools print is what HTCondor would read.

(``tests/integration/test_deploy_cobald.py`` gives HTCondor's submit reader
the drone JDL as TARDIS's own HTCondor site adapter writes it.)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import classad2
import htcondor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.emulation.execution_point import DEPLOY_CONFIG, DEPLOY_DIR
from broker.emulation.execution_point import classad as emu
from broker.emulation.execution_point.config import Config
from remote_agent import classad as ours
from remote_agent.hooks import HOOK_KEYWORD
from remote_agent.htcondor import GATE_ATTRIBUTE

OLD = classad2.ParserType.Old


def read_old(text: str) -> classad2.ClassAd:
    """``text`` as HTCondor reads ``Attr = value`` lines: exactly one ad"""
    ads = list(classad2.parseAds(text, OLD))
    assert len(ads) == 1, f"HTCondor reads {len(ads)} ads from {text!r}"
    return ads[0]


def as_ours(value: Any) -> ours.Value:
    """A value HTCondor evaluated, as the agent's reader represents it"""
    if value is classad2.Value.Undefined:
        return None
    assert isinstance(value, bool | int | float | str), value
    return value


# ---------------------------------------------------------------- configuration


@pytest.fixture
def condor_config(tmp_path: Path) -> Iterator[Path]:
    """HTCondor's configuration reader pointed at the drone's configuration"""
    config = tmp_path / "condor_config"
    config.write_text(
        f"LOCAL_DIR = {tmp_path}\n"
        "START = Memory > 4096\n"  # what the site's own execution-point config may say
        f"include : {DEPLOY_CONFIG}\n"
        f"COBALD_REMOTE_LIBEXEC = {DEPLOY_DIR}\n"
    )
    before = os.environ.get("CONDOR_CONFIG")
    os.environ["CONDOR_CONFIG"] = str(config)
    htcondor2.reload_config()
    yield config
    if before is None:
        del os.environ["CONDOR_CONFIG"]
    else:
        os.environ["CONDOR_CONFIG"] = before
    htcondor2.reload_config()


def emulated_config() -> Config:
    cfg = Config(environ={})
    cfg.set("START", "Memory > 4096")
    cfg.read(DEPLOY_CONFIG)
    cfg.set("COBALD_REMOTE_LIBEXEC", str(DEPLOY_DIR))
    return cfg


def test_htcondor_reads_the_hooks_we_configure(condor_config: Path) -> None:
    param = htcondor2.param
    assert param["STARTER_JOB_HOOK_KEYWORD"] == HOOK_KEYWORD
    for hook in ("PREPARE_JOB", "JOB_EXIT"):
        path = Path(param[f"{HOOK_KEYWORD}_HOOK_{hook}"])
        assert path.parent == DEPLOY_DIR and os.access(path, os.X_OK)
    assert int(param[f"{HOOK_KEYWORD}_HOOK_JOB_EXIT_TIMEOUT"]) > 0


@pytest.mark.parametrize(
    ("machine", "starts"),
    [
        ({"Memory": 8192, GATE_ATTRIBUTE: True}, True),
        ({"Memory": 8192}, False),  # undefined until the agent opens the gate
        ({"Memory": 8192, GATE_ATTRIBUTE: False}, False),
        ({"Memory": 2048, GATE_ATTRIBUTE: True}, False),  # the site's own START still rules
    ],
)
def test_htcondor_and_the_emulator_agree_on_start(
    condor_config: Path, machine: dict[str, Any], starts: bool
) -> None:
    start = htcondor2.param["START"]
    assert classad2.ExprTree(start).eval(classad2.ClassAd(machine)) is starts
    emulated = emulated_config().get("START") or ""
    nodes = {name: emu.literal(value) for name, value in machine.items()}
    assert emu.evaluate(emulated, nodes) is starts


def test_htcondor_ends_only_the_master_once_the_startd_is_gone(condor_config: Path) -> None:
    param = htcondor2.param
    assert param.get("DAEMON_SHUTDOWN") is None  # a global one would end the startd itself
    expr = classad2.ExprTree(param["MASTER.DAEMON_SHUTDOWN"])
    assert expr.eval(classad2.ClassAd({"STARTD_StartTime": 0})) is True
    assert expr.eval(classad2.ClassAd({"STARTD_StartTime": 1_700_000_000})) is False
    retirement = classad2.ExprTree(param["MAXJOBRETIREMENTTIME"]).eval()
    assert isinstance(retirement, int) and retirement >= 7 * 24 * 3600


def test_the_emulators_config_reader_reads_what_htcondor_reads(condor_config: Path) -> None:
    names = re.findall(r"^([A-Za-z_][A-Za-z0-9_.]*)\s*=", DEPLOY_CONFIG.read_text(), re.M)
    assert len(names) >= 8
    emulated = emulated_config()
    for name in names:
        subsystem, dot, knob = name.rpartition(".")
        value = emulated.get(knob, subsystem=subsystem) if dot else emulated.get(name)
        assert value == str(htcondor2.param[name]), name


# ---------------------------------------------------------------- expressions

#: expressions the emulated startd and tools evaluate (START, DAEMON_SHUTDOWN,
#: constraints of condor_status/condor_who), with machine ads to try them on
EXPRESSIONS = [
    "(True) && (DroneGateOpen =?= True)",
    "DroneGateOpen == True",
    "Undef && false",
    "Undef || true",
    "Undef && true",
    'State =!= "Claimed"',
    'State == "claimed"',
    'State =?= "claimed"',
    "STARTD_StartTime =?= 0",
    "ifThenElse(Cpus > 2, 1, 2) + 3 * 2",
    "isUndefined(nope) ? 10000000 : 0",
    "1 / 0",
    "7 % 3 - -2",
    'Memory >= 4096 && !(Activity == "Busy")',
    "isError(1 / 0) || Cpus < 1.5",
    'Name == "slot1@h\\"x"',
]
MACHINES = [
    {},
    {"DroneGateOpen": True, "State": "Claimed", "Cpus": 4, "Memory": 8192, "Activity": "Busy"},
    {"DroneGateOpen": False, "State": "Unclaimed", "Cpus": 1, "Memory": 2048, "Name": 'slot1@h"x'},
    {"STARTD_StartTime": 0, "Activity": "Idle", "Memory": 4096},
]


def _htcondor_eval(expr: str, machine: dict[str, Any]) -> emu.Value:
    value = classad2.ExprTree(expr).eval(classad2.ClassAd(machine))
    if value is classad2.Value.Undefined:
        return emu.UNDEFINED
    if value is classad2.Value.Error:
        return emu.ERROR
    assert isinstance(value, bool | int | float | str), value
    return value


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("expr", EXPRESSIONS)
def test_the_emulator_evaluates_as_htcondor_does(expr: str, machine: dict[str, Any]) -> None:
    nodes = {name: emu.literal(value) for name, value in machine.items()}
    assert emu.evaluate(expr, nodes) == _htcondor_eval(expr, machine)


# ---------------------------------------------------------------- long form

_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True).filter(
    lambda name: (
        name.casefold()
        not in {"true", "false", "undefined", "error", "is", "isnt", "parent", "my", "target"}
    )
)
#: what can stand in an ``Attr = value`` line: no line break, no NUL
_LINE_TEXT = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\n\x00"))
_VALUES = st.one_of(
    st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    _LINE_TEXT,
    st.just(classad2.ExprTree("undefined")),
    st.sampled_from(
        [classad2.ExprTree(e) for e in ("Cpus * 2", 'strcat("a", Name)', "x =?= undefined")]
    ),
)
_ADS = st.dictionaries(_NAMES, _VALUES, max_size=8).filter(
    lambda ad: len({name.casefold() for name in ad}) == len(ad)
)


@given(_ADS)
def test_the_agent_reads_long_form_as_htcondor_does(values: dict[str, Any]) -> None:
    ad = classad2.ClassAd()
    for name, value in values.items():
        ad[name] = value
    printed = ad.printOld()  # as condor_who -long and the starter's hook stdin print it
    theirs = read_old(printed) if values else classad2.ClassAd()
    parsed = ours.parse_ads(printed)
    mine = parsed[0] if parsed else ours.ClassAd()
    assert {name.casefold() for name in mine} == {name.casefold() for name in values}
    for name, value in values.items():
        if isinstance(value, classad2.ExprTree) and str(value) != "undefined":
            # not a literal: the agent keeps the expression's text as HTCondor printed it
            text = mine[name]
            assert isinstance(text, ours.Expr), name
            assert str(classad2.ExprTree(text)) == str(theirs.lookup(name)), name
        else:
            assert mine[name] == as_ours(theirs.eval(name)), name
            assert type(mine[name]) is type(as_ours(theirs.eval(name))), name


@given(st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00")))
def test_htcondor_reads_what_a_hook_prints_as_the_hook_meant_it(message: str) -> None:
    line = f"HookStatusMessage = {ours.quote(message)}"
    assert "\n" not in line
    expected = re.sub(r"\r\n|\r|\n", " ", message)
    assert read_old(f"HookStatusCode = 390\n{line}\n")["HookStatusMessage"] == expected
    assert ours.parse_value(ours.quote(message)) == expected


@given(_ADS)
def test_htcondor_reads_what_the_emulated_tools_print(values: dict[str, Any]) -> None:
    ad = emu.Ad()
    literals = {n: v for n, v in values.items() if not isinstance(v, classad2.ExprTree)}
    for name, value in literals.items():
        ad.set(name, value)
    if not literals:
        return
    theirs = read_old(ad.long())
    for name, value in literals.items():
        got = theirs[name]
        assert got == value and type(got) is type(value), name
    # and the emulator reads its own output back as HTCondor does
    again = emu.Ad.from_long(ad.long())
    assert {n: again.get(n) for n in literals} == literals
