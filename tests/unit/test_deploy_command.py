"""``cobald-remote deploy``: names are looked up among the shipped files, copies never clobber"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.cli import main
from remote_agent import deploy_files
from remote_agent.deploy_files import DEPLOY_DIR


def test_list_names_every_shipped_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", "list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == list(deploy_files.shipped())
    groups = {name.split("/")[0] for name in listed}
    assert {"htcondor", "cobald", "nats", "systemd", "image"} <= groups
    assert main(["deploy", "list", "htcondor", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert Path(result["root"]) == DEPLOY_DIR
    assert "htcondor/hook-prepare-job" in result["files"]


def test_show_prints_the_file(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    assert main(["deploy", "show", "nats/single.conf"]) == 0
    assert capsysbinary.readouterr().out == (DEPLOY_DIR / "nats" / "single.conf").read_bytes()


@pytest.mark.parametrize(
    "argv",
    [
        ["deploy", "list", "../../etc"],
        ["deploy", "show", "/etc/passwd"],
        ["deploy", "show", "htcondor/../nats/single.conf"],
        ["deploy", "show", "nats"],  # a group, not one file
        ["deploy", "copy", "", "out"],
    ],
)
def test_unknown_names_are_one_line(
    argv: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("cobald-remote: ") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_copy_refuses_to_replace_a_changed_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a" / "libexec"
    assert main(["deploy", "copy", "htcondor", str(target)]) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(
        str(target / name.split("/")[1]) for name in deploy_files.select("htcondor")
    )
    assert main(["deploy", "copy", "htcondor", str(target)]) == 0  # same files: fine
    capsys.readouterr()
    edited = target / "cobald-remote-drone.conf"
    edited.write_text("site edit\n")
    hook = target / "hook-prepare-job"
    hook.write_text("#!/bin/sh\n")
    assert main(["deploy", "copy", "htcondor", str(target)]) == 1
    assert "--force" in capsys.readouterr().err
    assert edited.read_text() == "site edit\n" and hook.read_text() == "#!/bin/sh\n"
    assert main(["deploy", "copy", "htcondor", str(target), "--force", "--json"]) == 0
    assert str(edited) in json.loads(capsys.readouterr().out)["written"]
    assert edited.read_bytes() == (DEPLOY_DIR / "htcondor" / edited.name).read_bytes()


def test_an_unwritable_target_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["deploy", "copy", "cobald/drone-job", str(blocker / "dir")]) == 1
    assert capsys.readouterr().err.startswith("cobald-remote: cannot copy")
