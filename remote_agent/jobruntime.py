"""
The runtime a payload's job ad requests or expects: which attributes say it, in which unit

The list is the agent's setting (``--runtime-attributes``, its default in
:mod:`remote_agent.settings`); the agent passes it to the job hooks in its worker's
environment (:data:`RUNTIME_ENV`), and the PREPARE_JOB hook reads the first attribute of
the list that the job ad carries as a number. Free of heavy imports: the hook imports it
on every payload start.
"""

from __future__ import annotations

import math
import re
from typing import Final

from remote_agent.classad import ClassAd, Expr

#: the variable that carries the list to the hooks (and the agent's own setting of it)
RUNTIME_ENV: Final = "COBALD_REMOTE_RUNTIME_ATTRIBUTES"
#: seconds per unit of an attribute
UNITS: Final = {"s": 1.0, "min": 60.0, "h": 3600.0}

#: one attribute of the list: its name and the seconds per unit of its value
RuntimeAttribute = tuple[str, float]

_NAME_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_attributes(text: str) -> tuple[RuntimeAttribute, ...]:
    """
    ``Name:unit,Name:unit`` (unit ``s``, ``min`` or ``h``; ``s`` if left out) as a list

    :raises ValueError: for a name that is no ClassAd attribute name, or an unknown unit
    """
    attributes: list[RuntimeAttribute] = []
    for item in text.split(","):
        if not item.strip():
            continue  # an empty item (a trailing comma)
        name, _, unit = item.partition(":")
        name, unit = name.strip(), unit.strip() or "s"
        if not _NAME_RE.match(name):
            raise ValueError(f"{name!r} is no job ad attribute name")
        if unit not in UNITS:
            raise ValueError(f"unit {unit!r} of {name} is not one of {', '.join(UNITS)}")
        attributes.append((name, UNITS[unit]))
    return tuple(attributes)


def format_attributes(attributes: tuple[RuntimeAttribute, ...]) -> str:
    """The list as :func:`parse_attributes` reads it"""
    unit_of = {seconds: unit for unit, seconds in UNITS.items()}
    return ",".join(f"{name}:{unit_of[seconds]}" for name, seconds in attributes)


def requested_runtime(ad: ClassAd, attributes: tuple[RuntimeAttribute, ...]) -> float | None:
    """
    Seconds from the first of ``attributes`` that ``ad`` carries as a number, else ``None``

    Only a literal counts: an expression (e.g. CMS WMAgent's ``MaxWallTimeMins``) is not
    evaluated, and the next attribute of the list is asked. A negative, infinite or
    non-numeric value counts as absent.
    """
    for name, seconds in attributes:
        value = ad.get(name)
        if isinstance(value, bool | Expr) or not isinstance(value, int | float):
            continue
        runtime = float(value) * seconds
        if 0 <= runtime < math.inf:
            return runtime
    return None
