"""
The drone's own batch job, as seen from inside it: what the site's batch system says of its end

Slurm knows each job's end time: since 23.02 it puts it in the job's environment
(``SLURM_JOB_END_TIME``, ``src/common/env.c``), and ``squeue -o %e`` tells it with
``SLURM_TIME_FORMAT=%s`` as epoch seconds (``slurm_make_time_str``,
``src/common/parse_time.c``). An HTCondor job that the site limits carries the limit in its
own job ad (``AllowedJobDuration``, ``AllowedExecuteDuration``: seconds, the job is held
beyond them). TARDIS's Slurm adapter also passes the time limit it asked for as
``SLURM_Walltime`` (:func:`parse_slurm_time` reads it; the settings take it).

An absolute time is the batch system's clock, the drone's may be wrong: each is turned into a
span on the node's clock the moment it is read (the caller counts the span on the monotonic
clock from then on), and a span that is not positive says that the clocks disagree, not that
the job has ended: it is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from remote_agent.classad import Expr, parse_ad

#: Slurm's job id in the job's environment
SLURM_JOB_ID_ENV: Final = "SLURM_JOB_ID"
#: the job's projected end, epoch seconds (Slurm 23.02 and later)
SLURM_END_TIME_ENV: Final = "SLURM_JOB_END_TIME"
#: the drone's own job ad on an HTCondor site (set by the starter)
CONDOR_JOB_AD_ENV: Final = "_CONDOR_JOB_AD"
#: the limits of an HTCondor job, in seconds (HTCondor's manual, "Job ClassAd Attributes")
CONDOR_LIMITS: Final = ("AllowedJobDuration", "AllowedExecuteDuration")
#: the most of a job ad read, in bytes
MAX_JOB_AD_BYTES: Final = 1 << 20

# Slurm's time formats (sbatch --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_SLURM_TIME_RE = re.compile(r"\A(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\Z")
_UNLIMITED = frozenset({"UNLIMITED", "INFINITE", "NONE"})


class EndUnknown(Exception):
    """The batch system did not say when the job ends (the reason is the message)"""


@dataclass(frozen=True, slots=True)
class BatchJob:
    """
    The drone's batch job as its environment describes it

    :param slurm_job_id: ``SLURM_JOB_ID``: the job runs under Slurm
    :param slurm_end_time: ``SLURM_JOB_END_TIME``, epoch seconds by the batch system's clock
    :param condor_job_ad: ``_CONDOR_JOB_AD``: the job runs under an HTCondor starter
    """

    slurm_job_id: str | None = None
    slurm_end_time: float | None = None
    condor_job_ad: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> BatchJob:
        """What the environment says; a value that is no number or path counts as absent"""
        job_id = env.get(SLURM_JOB_ID_ENV, "").strip()
        end = env.get(SLURM_END_TIME_ENV, "").strip()
        ad = env.get(CONDOR_JOB_AD_ENV, "").strip()
        return cls(
            slurm_job_id=job_id if job_id.isdigit() else None,
            slurm_end_time=float(end) if end.isdigit() and int(end) > 0 else None,
            condor_job_ad=Path(ad) if ad and os.path.isabs(ad) else None,
        )


def parse_slurm_time(text: str) -> float | None:
    """
    A Slurm time limit (``sbatch --time``: minutes, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``) in seconds; ``None`` for no limit (``UNLIMITED``, ``INFINITE``)

    :raises ValueError: for anything else
    """
    text = text.strip()
    if text.upper() in _UNLIMITED:
        return None
    match = _SLURM_TIME_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is no Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)")
    days, first, second, third = (int(part) if part else None for part in match.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = first or 0, second or 0, third or 0
    elif third is not None:  # H:M:S
        hours, minutes, seconds = first or 0, second or 0, third
    else:  # M, M:S
        hours, minutes, seconds = 0, first or 0, second or 0
    return float((((days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds)


def span_until(epoch_s: float, now: float | None = None) -> float:
    """
    Seconds from now on the node's clock to ``epoch_s``, a time of the batch system's clock

    :raises EndUnknown: if that is not a positive, finite number of seconds
    """
    span = epoch_s - (time.time() if now is None else now)
    if not 0 < span < math.inf:
        raise EndUnknown(
            f"the end it gives ({epoch_s:.0f}) is {-span:.0f}s before the node's clock"
            " says now: the clocks disagree"
        )
    return span


async def slurm_end(job_id: str, *, timeout_s: float = 10.0) -> float:
    """
    The epoch second at which Slurm ends job ``job_id``: ``squeue -h -j ID -o %e``

    :raises EndUnknown: if ``squeue`` cannot be run, fails, or says no time
    """
    env = {**os.environ, "SLURM_TIME_FORMAT": "%s"}
    try:
        proc = await asyncio.create_subprocess_exec(
            "squeue",
            "-h",
            "-j",
            job_id,
            "-o",
            "%e",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as err:
        raise EndUnknown(f"cannot run squeue: {err}") from err
    try:
        async with asyncio.timeout(timeout_s):
            out, err_out = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise EndUnknown(f"squeue did not answer within {timeout_s:g}s") from None
    except asyncio.CancelledError:
        # the agent stopped asking: squeue does not outlive the call
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(asyncio.CancelledError):
            await proc.wait()
        raise
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0:
        said = " ".join(err_out.decode(errors="replace").split())[:200] or "(no output)"
        raise EndUnknown(f"squeue exited with {proc.returncode}: {said}")
    first = text.splitlines()[0].strip() if text else ""
    if not first.isdigit() or int(first) <= 0:
        raise EndUnknown(f"squeue gave no end time for job {job_id}: {first[:40]!r}")
    return float(first)


def condor_job_limit(path: Path) -> float:
    """
    The smaller of the limits (:data:`CONDOR_LIMITS`, seconds) in the job ad at ``path``

    :raises EndUnknown: if the ad cannot be read or sets neither limit as a positive number
    """
    try:
        with path.open("rb") as stream:
            ad = parse_ad(stream.read(MAX_JOB_AD_BYTES).decode("utf-8", errors="replace"))
    except OSError as err:
        raise EndUnknown(f"cannot read the job ad {path}: {err}") from err
    limits = []
    for name in CONDOR_LIMITS:
        value = ad.get(name)
        if isinstance(value, bool | Expr) or not isinstance(value, int | float):
            continue
        if 0 < value < math.inf:
            limits.append(float(value))
    if not limits:
        raise EndUnknown(f"the job ad sets no limit ({', '.join(CONDOR_LIMITS)})")
    return min(limits)
