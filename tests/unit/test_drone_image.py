"""
The drone image recipes (``deploy/image``): every file they name ships

Images cannot be built here; what is checked is that the Containerfile and the
Apptainer definition run the same install steps, that every deployment file and
path those steps name exists, and that they agree with the startd configuration
and the drone job's JDL; and that the drone job, the image's entry point, gives
the drone's HTCondor a scratch directory, the pool and the token from the
environment, as HTCondor's own configuration reader sees them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from remote_agent import deploy_files
from remote_agent.deploy_files import DEPLOY_DIR

IMAGE = DEPLOY_DIR / "image"
CONTAINERFILE = (IMAGE / "Containerfile").read_text()
APPTAINER = (IMAGE / "cobald-remote-drone.def").read_text()
INSTALL = (IMAGE / "install-drone").read_text()
STARTD = (DEPLOY_DIR / "htcondor" / "cobald-remote-drone.conf").read_text()
JDL = (DEPLOY_DIR / "cobald" / "drone.jdl").read_text()

RECIPES = {"Containerfile": CONTAINERFILE, "apptainer": APPTAINER}


def _default(name: str) -> str:
    """The default of the variable ``name`` in install-drone (``${NAME:-default}``)"""
    found = re.search(rf"\$\{{{name}:-([^}}]+)\}}", INSTALL)
    assert found, name
    return found.group(1)


def _copied() -> dict[str, str]:
    """What install-drone copies into LIBEXEC: file name -> the name it is shipped as"""
    names = re.findall(r"deploy copy (\S+) \"\$libexec\"", INSTALL)
    assert names
    return {key.split("/")[1]: key for name in names for key in deploy_files.select(name)}


def _sources(recipe: str) -> list[str]:
    """The build-context files a recipe copies in (COPY lines, the %files section)"""
    copies = re.findall(r"^COPY (\S+) \S+$", recipe, re.M)
    section = re.search(r"^%files\n((?:[ \t]+\S.*\n)+)", recipe, re.M)
    files = [line.split()[0] for line in section.group(1).splitlines()] if section else []
    return copies + files


def test_every_name_the_install_steps_use_ships() -> None:
    for name in re.findall(r"deploy (?:copy|show) (\S+)", INSTALL):
        assert deploy_files.select(name), name
    shown = re.findall(r"deploy show (\S+)", INSTALL)
    assert shown == ["htcondor/cobald-remote-drone.conf"]


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_both_recipes_copy_the_wheel_and_the_shipped_install_script(recipe: str) -> None:
    sources = _sources(recipe)
    assert sorted(sources) == ["*.whl", "install-drone"]
    assert {f"image/{s}" for s in sources if "*" not in s} <= set(deploy_files.shipped())
    assert "sh /tmp/install-drone /tmp/wheels" in recipe
    assert re.search(r"cobald_remote-\*\.whl", INSTALL)


def test_the_recipes_share_one_base_and_one_entry() -> None:
    base = re.search(r"^ARG BASE=(?:docker\.io/)?(\S+)$", CONTAINERFILE, re.M)
    assert base and f"\nFrom: {base.group(1)}\n" in APPTAINER
    assert base.group(1).startswith("htcondor/execute:")
    job = f"{_default('LIBEXEC')}/drone-job"
    assert f'ENTRYPOINT ["{job}"]' in CONTAINERFILE
    assert f'exec {job} "$@"' in APPTAINER
    assert "drone-job" in _copied()


def test_python_is_at_least_3_11_everywhere() -> None:
    packages = {
        m for r in RECIPES.values() for m in re.findall(r"dnf install -y (python3\.\d+)", r)
    }
    assert packages == {_default("PYTHON")}
    minor = int(_default("PYTHON").removeprefix("python3."))
    assert minor >= 11
    assert "sys.version_info < (3, 11)" in INSTALL


def test_the_startd_and_the_jdl_find_what_install_drone_copies() -> None:
    libexec = _default("LIBEXEC")
    assert re.search(rf"^COBALD_REMOTE_LIBEXEC = {re.escape(libexec)}$", STARTD, re.M)
    hooks = re.findall(r"^\S+ = \$\(COBALD_REMOTE_LIBEXEC\)/(\S+)$", STARTD, re.M)
    assert hooks and set(hooks) <= set(_copied())
    executable = re.search(r"^executable = (\S+)$", JDL, re.M)
    assert executable and executable.group(1) == f"{libexec}/drone-job"
    for recipe in RECIPES.values():
        assert "PATH=/opt/cobald-remote/bin:$PATH" in recipe
    assert _default("PREFIX") == "/opt/cobald-remote"


def test_libexec_gets_the_hooks_and_the_drone_job_alone() -> None:
    copied = _copied()
    hooks = re.findall(r"^\S+ = \$\(COBALD_REMOTE_LIBEXEC\)/(\S+)$", STARTD, re.M)
    assert set(copied) == {*hooks, "drone-job"}
    shipped = deploy_files.shipped()
    assert all(shipped[name].read_bytes().startswith(b"#!") for name in copied.values())
    # the startd configuration goes to CONDOR_CONFIG_D, under the name the recipes document
    assert '> "$config_d/90-cobald-remote.conf"' in INSTALL


def test_copied_scripts_are_executable(tmp_path: Path) -> None:
    target = tmp_path / "libexec"
    written = deploy_files.copy("htcondor", target) + deploy_files.copy("image", target)
    modes = {path.name: path.stat().st_mode & 0o777 for path in written}
    assert modes["hook-prepare-job"] == modes["install-drone"] == 0o755
    assert modes["cobald-remote-drone.conf"] == modes["Containerfile"] == 0o644


DRONE_JOB = DEPLOY_DIR / "cobald" / "drone-job"
#: what the drone job gives the drone's HTCondor, from the startd configuration's section 6
KNOBS = ["LOCAL_DIR", "LOG", "EXECUTE", "SPOOL", "LOCK", "RUN", "CONDOR_HOST"]
KNOBS += ["SEC_TOKEN_DIRECTORY", "NUM_CPUS", "MEMORY"]


def _run_drone_job(tmp_path: Path, **env: str) -> dict[str, str]:
    """The shipped drone job, its agent a stub that records its arguments and environment"""
    stub = tmp_path / "cobald-remote"
    stub.write_text('#!/bin/sh\necho "$*" > "$0.args"\nenv > "$0.env"\n')
    stub.chmod(0o755)
    base = {"PATH": os.environ["PATH"], "COBALD_REMOTE": str(stub)}
    subprocess.run([str(DRONE_JOB)], env=base | env, check=True, timeout=30)
    assert stub.with_suffix(".args").read_text() == "agent run -- condor_master -f\n"
    lines = stub.with_suffix(".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_the_startd_configuration_names_every_knob_the_drone_job_sets() -> None:
    section = STARTD.partition("## 6.")[2]
    assert all(re.search(rf"\b{knob}\b", section) for knob in KNOBS)
    exported = set(re.findall(r"_CONDOR_([A-Z_]+)=", DRONE_JOB.read_text()))
    assert exported == set(KNOBS)


def test_the_drone_job_puts_htcondor_in_its_scratch_dir_and_pool(tmp_path: Path) -> None:
    scratch, token = tmp_path / "scratch", tmp_path / "pool.token"
    scratch.mkdir()
    token.write_text("eyJ0b2tlbiI\n")
    env = _run_drone_job(
        tmp_path,
        _CONDOR_SCRATCH_DIR=str(scratch),
        CONDOR_HOST="cm.example.org",
        COBALD_REMOTE_CONDOR_TOKEN=str(token),
        NUM_CPUS="8",
    )
    local = Path(env["_CONDOR_LOCAL_DIR"])
    assert local.parent == scratch and local.is_dir()
    for knob in ("LOG", "EXECUTE", "SPOOL", "LOCK", "RUN"):
        assert Path(env[f"_CONDOR_{knob}"]) == local / knob.lower()
        assert (local / knob.lower()).is_dir()
    assert env["_CONDOR_CONDOR_HOST"] == "cm.example.org"
    assert env["_CONDOR_NUM_CPUS"] == "8" and "_CONDOR_MEMORY" not in env
    tokens = Path(env["_CONDOR_SEC_TOKEN_DIRECTORY"])
    assert tokens.stat().st_mode & 0o777 == 0o700
    assert (tokens / "pool").stat().st_mode & 0o777 == 0o600
    assert (tokens / "pool").read_text() == token.read_text()


def test_the_drone_job_leaves_the_pool_and_token_to_the_configuration(tmp_path: Path) -> None:
    own = tmp_path / "condor"
    env = _run_drone_job(tmp_path, COBALD_REMOTE_CONDOR_DIR=str(own), TMPDIR=str(tmp_path))
    assert env["_CONDOR_LOCAL_DIR"] == str(own) and (own / "log").is_dir()
    assert not {"_CONDOR_CONDOR_HOST", "_CONDOR_SEC_TOKEN_DIRECTORY"} & set(env)


def test_a_missing_token_stops_the_drone_job(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(DRONE_JOB)],
        env={
            "PATH": os.environ["PATH"],
            "COBALD_REMOTE": "/bin/false",
            "TMPDIR": str(tmp_path),
            "COBALD_REMOTE_CONDOR_TOKEN": str(tmp_path / "absent"),
        },
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert result.returncode != 0 and "absent" in result.stderr


def test_htcondor_reads_the_drone_jobs_settings_over_its_files(tmp_path: Path) -> None:
    """HTCondor's own configuration reader (the htcondor2 wheel), the startd file included"""
    pytest.importorskip("htcondor2")
    config = tmp_path / "condor_config"
    config.write_text(
        "LOCAL_DIR = /var\nLOG = /var/log/condor\nCONDOR_HOST = site-cm\n"
        f"include : {DEPLOY_DIR / 'htcondor' / 'cobald-remote-drone.conf'}\n"
    )
    env = _run_drone_job(tmp_path, TMPDIR=str(tmp_path), CONDOR_SERVICE_HOST="cm.example.org")
    probe = "import htcondor2; print(*(htcondor2.param[k] for k in ('LOG', 'CONDOR_HOST')))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env=env | {"CONDOR_CONFIG": str(config)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.split() == [env["_CONDOR_LOG"], "cm.example.org"]
