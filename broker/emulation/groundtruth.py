"""
The emulators' ground truth: what really happened, as JSON lines

Its rule: written by the emulators themselves, independently of the agent and the bus,
so tests can compare what the agent published with what happened.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


class GroundTruth:
    """
    Append-only writer; every line is flushed at once

    One object per line: ``{"t": <unix seconds>, "event": <name>, ...fields}``. The
    events of the emulated execution point:

    =====================  ============================================================
    ``master_started``     the emulated ``condor_master`` runs (``pid``)
    ``startd_ready``       the startd answers (``startd_pid``)
    ``gate``               ``condor_update_machine_ad`` set ``attribute`` to ``value``
    ``offer_rejected``     an offered job was not claimed (``reason``: START, draining,
                           no free slot, no startd)
    ``claimed``            a slot was claimed and activated for ``job_id`` on ``slot``
    ``prepare_job``        the PREPARE_JOB hook ended (``exit_status``, ``hook_status_code``,
                           ``message``, ``wall_s``, ``decision``: run/idle/hold)
    ``payload_refused``    the job went back to idle without running (``status``)
    ``payload_held``       the job was put on hold (``hold_subcode``)
    ``payload_started``    the payload runs (``slot``, ``duration_s``)
    ``payload_finished``   the payload exited by itself (``exit_code``, ``runtime_s``)
    ``payload_killed``     the payload was killed (``reason``, ``runtime_s``)
    ``payload_vacated``    the claim was vacated while PREPARE_JOB ran (``reason``)
    ``job_exit``           the JOB_EXIT hook ended (``reason``, ``exit_status``, ``timed_out``)
    ``drain_requested``    ``condor_drain`` (``how``, ``on_completion``, ``accepted``, ...)
    ``drain_cancelled``    ``condor_drain -cancel``
    ``drain_completed``    no slot runs a job any more
    ``startd_exited``      the startd ended (``why``)
    ``master_exiting``     the emulated master ends (``exit_code``, ``why``)
    =====================  ============================================================
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stream: TextIO = path.open("a", encoding="utf-8")

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, **fields}, sort_keys=True)
        self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


def read_ground_truth(path: Path) -> list[dict[str, Any]]:
    """Every event so far (a torn last line, being written, is skipped)"""
    if not path.exists():
        return []
    events: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
