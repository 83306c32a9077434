"""
``cobald-remote check-config`` on the deployed configurations and on bad ones, and the real
COBalD daemon on a bad ``bus:`` section: one line per problem, naming its key, exit 1
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support.processes import CLI, run_process

from broker.emulation.demo.scenario import Scenario
from broker.emulation.demo.template import render_config
from remote_agent.deploy_files import DEPLOY_DIR

pytestmark = pytest.mark.timeout(120)

DEPLOY = DEPLOY_DIR / "cobald"
HTCONDOR = (DEPLOY / "htcondor.yaml").read_text()
TARDIS_SECTION = HTCONDOR[HTCONDOR.index("tardis:\n") :]


def _write(tmp_path: Path, text: str, name: str = "cobald.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


async def test_the_htcondor_config_is_valid_and_described(tmp_path: Path) -> None:
    code, out, err = await run_process(*CLI, "check-config", str(DEPLOY / "htcondor.yaml"))
    assert code == 0, err
    rows = dict(line.split("  ", 1) for line in out.splitlines()[2:] if "  " in line)
    assert out.splitlines()[0].endswith("htcondor.yaml: pipeline[3]: !RemoteTardisPoolFactory")
    assert "MySite (HTCondor, quota 400, machine types wn8; drones mysite-" in out
    assert rows["drone servers"].strip() == "nats://nats-leaf.site.example.org:4222"
    assert rows["metrics"].strip() == "http://127.0.0.1:9464/metrics"
    assert rows["retain_ended_s"].strip() == "86400 s"
    assert rows["retain_lost_s"].strip() == "604800 s"
    assert rows["black holes"].strip() == "a site is flagged after 3 black-hole drones in a row"
    assert rows["black_hole_lifetime_s"].strip() == "600 s"
    assert rows["domain"].strip() == "hub"
    assert out.rstrip().endswith("htcondor.yaml: valid")
    # the credentials file of the example does not exist here: a warning that says what to do
    assert err.splitlines() == [
        "cobald-remote: warning: bus.creds: /etc/cobald-remote/manager.creds does not exist; "
        "write it with `cobald-remote auth manager --authority FILE "
        "--out /etc/cobald-remote/manager.creds`"
    ]


@pytest.mark.parametrize("demand", ["scripted", "controller"])
@pytest.mark.parametrize("bus", [True, False], ids=["with-bus", "stock"])
async def test_the_demo_config_is_valid(tmp_path: Path, bus: bool, demand: str) -> None:
    section = {"servers": "nats://127.0.0.1:4222", "lost_after_s": 10} if bus else None
    scenario = Scenario(demand=demand)
    path = _write(tmp_path, render_config(scenario, tmp_path, start=0.0, bus=section))
    code, out, err = await run_process(*CLI, "check-config", str(path), cwd=tmp_path)
    assert code == 0, err
    assert "Demo (" in out
    assert (re.search(r"^lost_after_s +10 s$", out, re.MULTILINE) is not None) is bus
    assert ("no bus section: stock TARDIS" in err) is not bus


async def test_the_split_form_reads_the_tardis_file(tmp_path: Path) -> None:
    _write(tmp_path, TARDIS_SECTION.replace("tardis:\n", "", 1).replace("\n  ", "\n")[2:], "t.yml")
    pipeline = HTCONDOR[: HTCONDOR.index("tardis:\n")]
    text = pipeline.replace("interval: 30 ", "configuration: t.yml\n    interval: 30 ")
    path = _write(tmp_path, text)
    code, out, err = await run_process(*CLI, "check-config", str(path), cwd=tmp_path)
    assert code == 0, err
    assert re.search(rf"^TARDIS configuration +{re.escape(str(tmp_path / 't.yml'))}$", out, re.M)
    assert "MySite (HTCondor" in out


@pytest.mark.parametrize(
    ("change", "lines"),
    [
        (
            ("lost_after_s: 90 ", 'lost_after_s: abc\n      drone_environment: "no"\n      #'),
            [
                "bus.lost_after_s: expected a number of seconds > 0 (at most 10 years), got 'abc'",
                "bus.drone_environment: expected true or false, got 'no'",
            ],
        ),
        (
            ("servers: nats://nats1.example.org:4222,", "servers: http://nats1.example.org:4222,"),
            ["bus.servers: expected NATS URLs (nats://, tls://, ws://, wss://HOST:PORT)"],
        ),
        (("prefix: cobald", "prefix: a.b"), ["bus.prefix: expected a subject token"]),
        (("MySite", "My.Site"), ["tardis.Sites: site name 'My.Site' in lower case"]),
        (("adapter: HTCondor\n    max_age", "adapter: Nope\n    max_age"), ["tardis.BatchSystem"]),
        (("interval: 30 ", "buss: {}\n    interval: 30 "), ["unexpected keyword argument 'buss'"]),
        (
            ("tardis:\n", "tardiss:\n"),
            [
                "unknown sections (COBalD refuses them): ['tardiss']",
                "tardis: expected TARDIS's configuration",
            ],
        ),
    ],
)
async def test_bad_files_give_one_line_per_problem(
    tmp_path: Path, change: tuple[str, str], lines: list[str]
) -> None:
    assert change[0] in HTCONDOR
    path = _write(tmp_path, HTCONDOR.replace(*change))
    code, out, err = await run_process(*CLI, "check-config", str(path))
    assert code == 1
    problems = [line for line in err.splitlines() if "warning:" not in line]
    assert len(problems) == len(lines), err
    for line, expected in zip(problems, lines, strict=True):
        assert line.startswith("cobald-remote: ")
        assert expected in line
    assert "Traceback" not in err
    assert out.rstrip().endswith("not valid") or out == ""


async def test_unreadable_and_foreign_files(tmp_path: Path) -> None:
    code, _, err = await run_process(*CLI, "check-config", str(tmp_path / "missing.yaml"))
    assert (code, err.count("\n")) == (1, 1)
    assert "No such file or directory" in err
    code, _, err = await run_process(
        *CLI, "check-config", str(_write(tmp_path, "pipeline: [{__type__: x.Y}]\n"))
    )
    assert code == 1
    assert "no cobald-remote pool factory" in err


async def test_the_real_daemon_names_the_key_without_tracebacks(tmp_path: Path) -> None:
    bad = HTCONDOR.replace("lost_after_s: 90 ", "lost_after_s: abc", 1)
    path = _write(tmp_path, bad)
    code, _, err = await run_process(sys.executable, "-m", "cobald.daemon", str(path), cwd=tmp_path)
    assert code == 1
    line = "bus.lost_after_s: expected a number of seconds > 0 (at most 10 years), got 'abc'"
    assert f"invalid configuration: {line}" in err
    assert "Traceback" not in err
    # COBalD's own start-up and shutdown lines, ours, and COBalD's three reports of it
    assert len(err.splitlines()) < 30, err


async def test_json_is_one_document_with_what_the_text_says(tmp_path: Path) -> None:
    code, out, err = await run_process(
        *CLI, "check-config", str(DEPLOY / "htcondor.yaml"), "--json"
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["valid"], report["problems"]) == (True, [])
    assert report["warnings"][0].startswith("bus.creds: /etc/cobald-remote/manager.creds does not")
    (factory,) = report["factories"]
    assert factory["sites"] == [
        {
            "name": "MySite",
            "adapter": "HTCondor",
            "quota": "400",
            "machine_types": ["wn8"],
            "drone_site": "mysite",
        }
    ]
    bus = factory["bus"]
    assert bus["drone_servers"] == ["nats://nats-leaf.site.example.org:4222"]
    assert bus["creds"] == {"path": "/etc/cobald-remote/manager.creds", "readable": False}
    assert (bus["prefix"], bus["stream"], bus["bucket"]) == (
        "cobald",
        "COBALD_EVENTS",
        "cobald-drones",
    )
    assert (bus["durable"], bus["domain"]) == ("cobald-registry", "hub")
    assert bus["metrics"] == "http://127.0.0.1:9464/metrics"
    assert (bus["lost_after_s"], bus["retain_ended_s"]) == (90, 86400)
    assert bus["retain_lost_s"] == 604800

    bad = _write(tmp_path, HTCONDOR.replace("lost_after_s: 90 ", "lost_after_s: abc #"))
    code, out, err = await run_process(*CLI, "check-config", str(bad), "--json")
    assert (code, err) == (1, "")
    report = json.loads(out)
    assert report["valid"] is False and report["factories"][0]["bus"] == {"valid": False}
    assert [line.split(":")[0] for line in report["problems"]] == ["bus.lost_after_s"]
    stock = render_config(Scenario(), tmp_path, start=0.0, bus=None)
    code, out, _ = await run_process(*CLI, "check-config", str(_write(tmp_path, stock)), "--json")
    assert code == 0 and json.loads(out)["factories"][0]["bus"] is None


async def test_the_bootstrap_settings_of_a_new_site_are_shown(tmp_path: Path) -> None:
    # docs/deployment.md, "A new site, step by step", step 7's keys, then step 9's check
    doc = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    step = doc[doc.index("7. The `bus:` section") :]
    block = step[step.index("```yaml\n") + 8 : step.index("```\n", step.index("```yaml"))]
    keys = [line.strip() for line in block.splitlines() if "bootstrap" in line]
    keys = [key.lstrip("# ").split("#")[0].strip() for key in keys]
    assert [key.split(":")[0] for key in keys] == [
        "bootstrap_key",
        "bootstrap_creds",
        "bootstrap_token_valid_s",
        "bootstrap_jwt_valid_s",
    ]
    keys[2:] = ["bootstrap_token_valid_s: 7200", "bootstrap_jwt_valid_s: 600"]
    anchor = "      request_timeout_s: 2\n"
    text = HTCONDOR.replace(anchor, anchor + "".join(f"      {key}\n" for key in keys))
    path = _write(tmp_path, text)
    code, out, _ = await run_process(*CLI, "check-config", str(path))
    assert code == 0
    rows = {
        key: value.strip()
        for key, _, value in (line.partition("  ") for line in out.splitlines()[2:])
    }
    assert rows["bootstrap_key"] == (
        "/etc/cobald-remote/issuer-key.json (the manager issues each drone its own identity)"
    )
    assert rows["bootstrap_creds"] == "/etc/cobald-remote/{site}-bootstrap.creds on the drones"
    assert rows["bootstrap_token_valid_s"] == "7200 s"
    assert rows["bootstrap_jwt_valid_s"] == "600 s"
    code, out, _ = await run_process(*CLI, "check-config", str(path), "--json")
    bus = json.loads(out)["factories"][0]["bus"]
    assert bus["bootstrap_key"] == "/etc/cobald-remote/issuer-key.json"
    assert (bus["bootstrap_token_valid_s"], bus["bootstrap_jwt_valid_s"]) == (7200, 600)
