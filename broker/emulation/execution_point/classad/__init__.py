"""
Just enough of the ClassAd language for the emulated startd

Written independently of ``remote_agent/classad.py`` on purpose: the emulator
checks the product, so it must not share the product's parser. ``expr.py``: the
language (values, parser, operators); ``ad.py``: scopes, evaluation and ads.
"""

from broker.emulation.errors import ClassAdSyntaxError
from broker.emulation.execution_point.classad.ad import (
    Ad,
    Scope,
    evaluate,
    literal,
    unparse_value,
)
from broker.emulation.execution_point.classad.expr import (
    ERROR,
    UNDEFINED,
    Node,
    Value,
    parse,
)

__all__ = [
    "ERROR",
    "UNDEFINED",
    "Ad",
    "ClassAdSyntaxError",
    "Node",
    "Scope",
    "Value",
    "evaluate",
    "literal",
    "parse",
    "unparse_value",
]
