"""The demo's final table, one column per run"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.emulation.demo.run import MODES


def _rows(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for section in ("drones", "payloads", "goodput"):
        for key, value in result.get(section, {}).items():
            rows.append((f"{section}: {key}", str(value)))
    latency = result["tardis_latency"]
    if "median_s" in latency:
        text = f"{latency['median_s']:.1f} / {latency['p90_s']:.1f} / {latency['max_s']:.1f}"
    else:
        text = "-"
    rows.append(("TARDIS saw a started drone running after (s, median/p90/max)", text))
    rows.append(("started drones TARDIS never saw running", str(latency["never_seen_running"])))
    cleanup = result["tardis_transitions"].get("Booting->Cleanup", 0)
    rows.append(
        ("TARDIS Booting->Cleanup (demand fell while queued, as TARDIS saw it)", str(cleanup))
    )
    queue = dict(result.get("queue", {}))
    wait = queue.pop("wait_s", None)
    for key, value in queue.items():
        rows.append((f"queue: payloads {key}", str(value)))
    if wait is not None:
        text = f"{wait['median']:.1f} / {wait['p90']:.1f} / {wait['mean']:.1f}"
        rows.append(("queue: wait from submit to start (s, median/p90/mean)", text))
    for key, value in result.get("controller", {}).items():
        rows.append((f"controller: {key}", str(value)))
    for label, value in result.get("slurm", {}).items():
        rows.append((f"Slurm: {label}", str(value)))
    for label, count in result.get("handshake_records", {}).items():
        rows.append((f"handshake record: {label}", str(count)))
    return rows


def table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The final table, one column per run"""
    modes = list(results)
    columns = [dict(_rows(results[mode])) for mode in modes]
    labels: list[str] = []
    for mode in modes:
        for label, _ in _rows(results[mode]):
            if label not in labels:
                labels.append(label)
    header = ["", *(MODES[mode] for mode in modes)]
    lines = [header] + [[label, *(col.get(label, "-") for col in columns)] for label in labels]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in lines
    )
