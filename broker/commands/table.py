"""Command output for people (an aligned table) and for scripts (indented JSON)"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """``header`` and ``rows`` in columns two spaces apart, without trailing blanks"""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    )


def write_json(value: object) -> None:
    """``value`` as indented JSON on stdout"""
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
