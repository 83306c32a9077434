"""
The drone-side install on disk and at start-up, beside an install of everything

Builds the wheel of the checkout, fetches once what it needs into a wheelhouse
(``pip wheel``; ``--wheelhouse DIR`` keeps it for the next run, ``--offline``
uses it as it is), then makes fresh venvs (``python -m venv``) that install
from the wheelhouse alone (no index), so all three have the same versions:

* **everything** (``pip install 'cobald_remote-*.whl[manager]'``): the manager's
  install, which a drone would get from one install of the whole product; the baseline;
* **drone side** (``pip install cobald_remote-*.whl``);
* **drone image** (the shipped ``install-drone`` script, as the image recipes
  run it: it removes pip and setuptools once the drone side is in).

For each it measures the bytes of the files in ``site-packages`` (the
distributions there, and how much of it is pip and setuptools), and the wall
time of ``cobald-remote agent run --help`` and of ``python -c pass`` (the
interpreter alone), best and median of ``--runs``, the installs taking turns.
Ratios are against the baseline of the same run. Nothing is asserted.

Usage::

    python bench/footprint.py                          # 15 runs each, a few minutes
    python bench/footprint.py --wheelhouse /tmp/wh     # keep the fetched wheels
    python bench/footprint.py --wheelhouse /tmp/wh --offline --runs 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import _common  # also puts the repository on sys.path

from remote_agent.deploy_files import DEPLOY_DIR

ROOT = _common.ROOT
INSTALL_DRONE = DEPLOY_DIR / "image" / "install-drone"
#: what ``python -m venv`` puts into every venv, and install-drone takes out again
TOOLING = {"pip", "setuptools"}
_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*_cache", "results"
)
#: a step that downloads or installs gives up after this long
STEP_TIMEOUT_S = 900


@dataclass
class Install:
    """One venv and what it holds"""

    name: str
    prefix: Path
    distributions: int = 0
    site_bytes: int = 0
    tooling_bytes: int = 0  #: of ``site_bytes``: pip and setuptools
    largest: list[tuple[str, int]] = field(default_factory=list)
    help_s: list[float] = field(default_factory=list)
    pass_s: list[float] = field(default_factory=list)

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"


def _run(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
    done = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
    )
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{done.stdout}{done.stderr}")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points Python or pip at the checkout, a venv or an index"""
    prefixes = ("PYTHON", "VIRTUAL_ENV", "PIP_", "COBALD_REMOTE_", "NATS_", "Tardis")
    env = {key: value for key, value in os.environ.items() if not key.startswith(prefixes)}
    scripts = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != scripts)
    return {**env, **extra}


def offline_env(wheelhouse: Path) -> dict[str, str]:
    """pip in a fresh venv: the wheelhouse alone, no index, no configuration of this machine"""
    return clean_env(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(wheelhouse),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_CACHE_DIR="1",
    )


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the checkout (the checkout stays clean)"""
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=_SKIP)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(out)]
    _run(
        [*pip_wheel, "--no-deps", "--no-build-isolation", str(source)],
        env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    shutil.rmtree(source)
    (wheel,) = out.glob("cobald_remote-*.whl")
    return wheel


def fill_wheelhouse(wheel: Path, wheelhouse: Path) -> None:
    """Wheels of all that ``wheel[manager]`` needs, from the machine's index, into ``wheelhouse``"""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse)]
    _run([*pip_wheel, "--find-links", str(wheelhouse), f"{wheel}[manager]"], env=env)
    for stale in wheelhouse.glob("cobald_remote-*.whl"):
        stale.unlink()  # the wheel under test is installed by its path


def venv_install(install: Install, requirement: str, wheelhouse: Path) -> None:
    env = offline_env(wheelhouse)
    _run([sys.executable, "-m", "venv", str(install.prefix)], env=env)
    _run([str(install.bin / "python"), "-m", "pip", "install", "--quiet", requirement], env=env)


def drone_image_install(install: Install, wheel: Path, wheelhouse: Path, root: Path) -> None:
    """``install-drone`` as the recipes run it, its paths under ``root``"""
    wheels = root / "wheels"  # install-drone takes the one cobald_remote-*.whl it finds here
    wheels.mkdir()
    shutil.copy2(wheel, wheels)
    for dependency in wheelhouse.glob("*.whl"):
        (wheels / dependency.name).symlink_to(dependency.resolve())
    env = offline_env(wheelhouse) | {
        "PYTHON": sys.executable,
        "PREFIX": str(install.prefix),
        "LIBEXEC": str(root / "libexec"),
        "CONDOR_CONFIG_D": str(root / "config.d"),
    }
    _run(["sh", str(INSTALL_DRONE), str(wheels)], env=env)


def site_packages(prefix: Path) -> Path:
    (site,) = prefix.glob("lib/python3*/site-packages")
    return site


def measure_disk(install: Install) -> None:
    """Bytes of the files in site-packages (symbolic links not followed), by distribution"""
    site = site_packages(install.prefix)
    install.site_bytes = sum(p.lstat().st_size for p in site.rglob("*") if not p.is_dir())
    sizes: dict[str, int] = {}
    for dist in metadata.distributions(path=[str(site)]):
        total = 0
        for file in dist.files or ():
            path = Path(str(dist.locate_file(file)))
            if path.is_relative_to(site) and (path.is_file() or path.is_symlink()):
                total += path.lstat().st_size
        sizes[dist.metadata["Name"].lower()] = total
    install.distributions = len(sizes)
    install.tooling_bytes = sum(sizes.get(name, 0) for name in TOOLING)
    install.largest = sorted(sizes.items(), key=lambda item: -item[1])[:8]


def time_once(argv: list[str], cwd: Path) -> float:
    env = clean_env()
    started = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{done.stderr.decode(errors='replace')}")
    return elapsed


def measure_startup(installs: list[Install], runs: int, cwd: Path) -> None:
    """``agent run --help`` and ``python -c pass`` of every install, taking turns; one warm-up"""
    for round_ in range(runs + 1):
        for install in installs:
            helped = time_once([str(install.bin / "cobald-remote"), "agent", "run", "--help"], cwd)
            passed = time_once([str(install.bin / "python"), "-c", "pass"], cwd)
            if round_:
                install.help_s.append(helped)
                install.pass_s.append(passed)


def venv_versions(install: Install) -> dict[str, str]:
    site = site_packages(install.prefix)
    return {d.metadata["Name"]: d.version for d in metadata.distributions(path=[str(site)])}


def report(installs: list[Install], wheel: Path, runs: int) -> dict[str, Any]:
    base = installs[0]
    rows = {}
    for install in installs:
        rows[install.name] = {
            "distributions": install.distributions,
            "site_packages_bytes": install.site_bytes,
            "pip_setuptools_bytes": install.tooling_bytes,
            "size_ratio": round(install.site_bytes / base.site_bytes, 3),
            "agent_run_help_s": {
                "best": min(install.help_s),
                "median": statistics.median(install.help_s),
                "runs": install.help_s,
            },
            "python_pass_s": {
                "best": min(install.pass_s),
                "median": statistics.median(install.pass_s),
            },
            "help_ratio": round(min(install.help_s) / min(base.help_s), 3),
            "largest_distributions": install.largest,
        }
    return {
        "what": "site-packages and `agent run --help` start-up of three installs of one wheel",
        "wheel": wheel.name,
        "runs": runs,
        "baseline": base.name,
        "installs": rows,
        "versions": venv_versions(base),
    }


def print_table(result: dict[str, Any]) -> None:
    header = (
        "install",
        "distributions",
        "site-packages MB",
        "pip+setuptools MB",
        "size / baseline",
        "--help best s",
        "median s",
        "--help / baseline",
        "python -c pass s",
    )
    rows = []
    for name, row in result["installs"].items():
        rows.append(
            (
                name,
                row["distributions"],
                f"{row['site_packages_bytes'] / 1e6:.1f}",
                f"{row['pip_setuptools_bytes'] / 1e6:.1f}",
                f"{row['size_ratio']:.3f}",
                f"{row['agent_run_help_s']['best']:.3f}",
                f"{row['agent_run_help_s']['median']:.3f}",
                f"{row['help_ratio']:.2f}",
                f"{row['python_pass_s']['best']:.3f}",
            )
        )
    print(_common.table(header, rows))
    runs = result["runs"]
    print(f"`cobald-remote agent run --help` and `python -c pass`: best and median of {runs}")
    for name, row in result["installs"].items():
        largest = ", ".join(f"{n} {b / 1e6:.1f}" for n, b in row["largest_distributions"][:5])
        print(f"largest in {name} (MB): {largest}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="start-ups timed per install (15)")
    parser.add_argument(
        "--wheelhouse", type=Path, help="keep the fetched wheels here (default: a temporary one)"
    )
    parser.add_argument(
        "--offline", action="store_true", help="use --wheelhouse as it is; ask no index"
    )
    parser.add_argument("--output", type=Path, help="JSON directory (default bench/results/)")
    args = parser.parse_args()
    if args.offline and not args.wheelhouse:
        parser.error("--offline needs --wheelhouse")
    with tempfile.TemporaryDirectory(prefix="cobald-remote-footprint-") as tmp_name:
        tmp = Path(tmp_name)
        wheel = build_wheel(tmp / "dist")
        wheelhouse = (args.wheelhouse or tmp / "wheelhouse").resolve()
        if not args.offline:
            fill_wheelhouse(wheel, wheelhouse)
        installs = [
            Install("everything [manager] (baseline)", tmp / "everything"),
            Install("drone side", tmp / "drone"),
            Install("drone image (install-drone)", tmp / "image" / "opt"),
        ]
        venv_install(installs[0], f"{wheel}[manager]", wheelhouse)
        venv_install(installs[1], str(wheel), wheelhouse)
        (tmp / "image").mkdir()
        drone_image_install(installs[2], wheel, wheelhouse, tmp / "image")
        for install in installs:
            measure_disk(install)
        work = tmp / "cwd"
        work.mkdir()
        measure_startup(installs, args.runs, work)
        result = report(installs, wheel, args.runs)
    print_table(result)
    path = _common.write_result("footprint", result, args.output)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
