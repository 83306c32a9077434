"""
``python -m broker.emulation``: drive an emulated execution point from a shell

::

    python -m broker.emulation offer STATE_DIR JOB_ID DURATION_S [--exit-code N]
    python -m broker.emulation status STATE_DIR
    python -m broker.emulation truth STATE_DIR        # the ground truth, one JSON object per line
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from broker.emulation.errors import EmulatorUnavailable
from broker.emulation.execution_point.paths import GROUND_TRUTH_FILE, control_socket_path
from broker.emulation.groundtruth import read_ground_truth
from broker.emulation.rpc import request_sync


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.emulation", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    offer = commands.add_parser("offer", help="offer a job; prints the outcome")
    offer.add_argument("state_dir", type=Path)
    offer.add_argument("job_id")
    offer.add_argument("duration_s", type=float)
    offer.add_argument("--exit-code", type=int, default=0)
    offer.add_argument("--owner", default="emulated")
    status = commands.add_parser("status", help="slots, drain and gate of the emulated startd")
    status.add_argument("state_dir", type=Path)
    truth = commands.add_parser("truth", help="print the ground truth")
    truth.add_argument("state_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "truth":
        for event in read_ground_truth(args.state_dir / GROUND_TRUTH_FILE):
            print(json.dumps(event, sort_keys=True))
        return 0
    request: dict[str, object] = {"op": args.command}
    if args.command == "offer":
        request.update(
            job_id=args.job_id,
            duration_s=args.duration_s,
            exit_code=args.exit_code,
            owner=args.owner,
        )
    try:
        reply = request_sync(control_socket_path(args.state_dir), request, timeout_s=600)
    except EmulatorUnavailable as err:
        print(f"no emulated master answers: {err}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2, sort_keys=True))
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
