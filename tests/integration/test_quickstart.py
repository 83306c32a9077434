"""
docs/quickstart.md, followed as written

Every ``console`` block of the page is run in order, line by line, with ``ETC`` and
``LIBEXEC`` under a temporary directory and ``SERVER`` this test's own nats-server. Not run:
the install (``python3 -m venv``, ``pip install``, ``export PATH``; the checkout's install,
first on ``PATH``, stands in) and the values line, whose variables this test sets. The test
does what the text between the blocks asks: it starts a nats-server in operator mode with the
``auth.conf`` of step 2 once ``auth manager`` ran, and the manager with the ``bus:`` section
of step 4 before the self-test. The Slurm site's drone job is not run (no Slurm here); its
commands are. The worked ``drone.env`` is sourced, and every variable it sets must be one the
drone job or the agent reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from support.manager import running_manager
from support.processes import run_process

from broker.manager.issuer import IssuerSettings
from broker.manager.service import ManagerSettings
from broker.server.embedded import EmbeddedServer
from remote_agent.deploy_files import DEPLOY_DIR

pytestmark = pytest.mark.timeout(240)
DOC = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
_BLOCK = re.compile(r"```(console|yaml|sh)\n(.*?)```", re.S)
#: the lines this test does not run: the values (it sets them) and the install
_NOT_RUN = (
    "export ETC=",
    "python3 -m venv ",
    "/opt/cobald-remote/bin/pip install ",
    "export PATH=",
)


def _blocks(kind: str) -> list[str]:
    return [text for found, text in _BLOCK.findall(DOC.read_text()) if found == kind]


def _lines() -> list[str]:
    return [line for _, line in _steps()]


def _steps() -> list[tuple[str, str]]:
    """Every command line of the page with the heading of its step (``5b. A Slurm site``)"""
    found = []
    for section in DOC.read_text().split("\n## ")[1:]:
        heading, _, text = section.partition("\n")
        for kind, block in _BLOCK.findall(text):
            if kind == "console":
                found += [(heading, line) for line in block.splitlines() if line.strip()]
    return found


def _values() -> dict[str, str]:
    line = next(line for line in _lines() if line.startswith("export ETC="))
    return dict(word.split("=", 1) for word in shlex.split(line)[1:])


@contextlib.asynccontextmanager
async def _server(tmp_path: Path, auth_conf: Path) -> AsyncIterator[EmbeddedServer]:
    """The server of step 2: JetStream, and the ``auth.conf`` the page's ``auth init`` wrote"""
    config = auth_conf.parent / "test-server.conf"  # an include is relative to its file
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth.conf"\n')
    async with EmbeddedServer(tmp_path / "nats", config_file=config) as server:
        yield server


def _manager(server: EmbeddedServer, etc: Path) -> ManagerSettings:
    """The manager as the ``bus:`` section of step 4 sets it, with ``/etc/cobald-remote`` at ETC"""
    bus = yaml.safe_load(_blocks("yaml")[0].replace("/etc/cobald-remote", str(etc)))["bus"]
    assert set(bus) == {"servers", "creds", "bootstrap_key", "bootstrap_creds"}, bus
    return ManagerSettings(
        servers=[server.url],
        creds=bus["creds"],
        retry_s=0.2,
        issuer=IssuerSettings(key=Path(bus["bootstrap_key"])),
    )


async def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    values = _values()
    assert set(values) == {"ETC", "LIBEXEC", "SERVER", "SITE"}
    etc, libexec = tmp_path / "etc", tmp_path / "libexec"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("COBALD_REMOTE", "NATS_"))},
        "ETC": str(etc),
        "LIBEXEC": str(libexec),
        "SITE": values["SITE"],
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    ran: dict[str, tuple[str, str]] = {}  # each line run: its stdout and stderr
    server: EmbeddedServer | None = None
    async with contextlib.AsyncExitStack() as stack:
        for heading, line in _steps():
            # a site is one or the other: the Slurm site's files go to a node of its own
            env["LIBEXEC"] = str(libexec if "Slurm" not in heading else tmp_path / "slurm")
            if line.startswith(_NOT_RUN):
                continue
            if line.startswith("cobald-remote broker init") and server is None:
                server = await stack.enter_async_context(
                    _server(tmp_path, etc / "nats" / "auth.conf")
                )
                env["SERVER"] = server.url
            if line.startswith("cobald-remote selftest"):
                assert server is not None
                await stack.enter_async_context(running_manager(_manager(server, etc)))
            code, out, err = await run_process("bash", "-euc", line, env=env, timeout_s=180)
            assert code == 0, (line, out, err)
            ran[line] = (out, err)
    last = list(ran)[-1]
    assert last.startswith("cobald-remote selftest") and out.splitlines()[-1] == "PASSED"
    assert "--bootstrap-creds" in last and "passed   enrolled" in out, out
    (status,) = (err for line, (_, err) in ran.items() if line.startswith("cobald-remote status"))
    assert "0 drones: 0 lost, 0 noisy, 0 ended" in status
    (init,) = (
        out for line, (out, _) in ran.items() if line.startswith("cobald-remote broker init")
    )
    assert "created" in init
    assert (libexec / "hook-prepare-job").exists() and (tmp_path / "slurm" / "drone-job").exists()


def test_the_worked_drone_env_sets_only_what_the_drone_reads() -> None:
    (block,) = _blocks("sh")
    drone_job = (DEPLOY_DIR / "slurm" / "drone-job").read_text()
    assert "/etc/cobald-remote/drone.env" in drone_job
    names = re.findall(r"^([A-Z_]+)=", block, re.M)
    done = subprocess.run(
        ["sh", "-euc", f"set -a; USER=drone; {block}\nenv"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    )
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    agent_doc = (DOC.parent / "agent.md").read_text()
    for name in names:
        assert name in exported, name
        read = name in ("COBALD_REMOTE", "TMPDIR") and name in drone_job + agent_doc
        assert read or f"`{name}`" in agent_doc, f"{name}: neither the drone job nor the agent"
    assert exported["TMPDIR"] == "/scratch/drone"
