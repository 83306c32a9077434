"""ClassAds of the emulated startd: evaluation scopes, printing, and the ``Ad`` itself"""

from __future__ import annotations

import re
from collections.abc import Mapping

from broker.emulation.errors import ClassAdSyntaxError
from broker.emulation.execution_point.classad.expr import (
    ERROR,
    UNDEFINED,
    Literal,
    Node,
    Value,
    parse,
)


class Scope:
    """Attribute lookup for evaluation: ``MY`` attributes, then ``TARGET`` for ``TARGET.x``"""

    def __init__(
        self, my: Mapping[str, Node], target: Mapping[str, Node] | None = None, depth: int = 0
    ) -> None:
        self.my = {k.casefold(): v for k, v in my.items()}
        self.target = {k.casefold(): v for k, v in (target or {}).items()}
        self.depth = depth

    def lookup(self, name: str) -> Value:
        if self.depth > 20:
            return ERROR
        folded = name.casefold()
        table = self.my
        if folded.startswith("my."):
            folded = folded[3:]
        elif folded.startswith("target."):
            folded, table = folded[7:], self.target
        node = table.get(folded)
        if node is None and table is self.my:
            node = self.target.get(folded)
        if node is None:
            return UNDEFINED
        return node.eval(self._child())

    def _child(self) -> Scope:
        child = Scope.__new__(Scope)
        child.my, child.target, child.depth = self.my, self.target, self.depth + 1
        return child


def evaluate(
    expression: str | Node, my: Mapping[str, Node], target: Mapping[str, Node] | None = None
) -> Value:
    """``expression`` in the context of ad ``my`` (and ``target``); ``ERROR`` if unparsable"""
    try:
        node = parse(expression) if isinstance(expression, str) else expression
    except ClassAdSyntaxError:
        return ERROR
    return node.eval(Scope(my, target))


def literal(value: Value) -> Node:
    """A Python value as an expression node"""
    return Literal(value)


def unparse_value(value: Value) -> str:
    """A value as HTCondor prints it in ``-long`` output"""
    if value is UNDEFINED:
        return "undefined"
    if value is ERROR:
        return "error"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'  # old syntax: backslashes as they are
    return repr(value) if isinstance(value, float) else str(value)


class Ad:
    """
    A ClassAd: attribute name (case-insensitive) -> expression, printed in ``-long`` form

    ``source`` keeps each expression's text as given, so that expressions that
    are not literals print as written.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.names: dict[str, str] = {}
        self.source: dict[str, str] = {}

    def set(self, name: str, value: Value) -> None:
        self.nodes[name.casefold()] = Literal(value)
        self.names[name.casefold()] = name
        self.source[name.casefold()] = unparse_value(value)

    def set_expr(self, name: str, text: str) -> None:
        """
        :raises ClassAdSyntaxError: ``text`` is not in the supported subset
        """
        self.nodes[name.casefold()] = parse(text)
        self.names[name.casefold()] = name
        self.source[name.casefold()] = text.strip()

    def remove(self, name: str) -> None:
        for table in (self.nodes, self.names, self.source):
            table.pop(name.casefold(), None)

    def get(self, name: str) -> Value:
        node = self.nodes.get(name.casefold())
        return UNDEFINED if node is None else node.eval(Scope(self.nodes))

    def update(self, other: Ad) -> None:
        self.nodes.update(other.nodes)
        self.names.update(other.names)
        self.source.update(other.source)

    def long(self) -> str:
        """``Attr = value`` lines sorted case-insensitively, as ``sPrintAdAttrs`` does"""
        return "".join(f"{self.names[key]} = {self.source[key]}\n" for key in sorted(self.names))

    @classmethod
    def from_long(cls, text: str) -> Ad:
        """
        An ad from ``Attr = expr`` lines

        :raises ClassAdSyntaxError: a line is not an assignment or its expression does not parse
        """
        ad = cls()
        for line in text.split("\n"):  # HTCondor ends lines at \n only
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, sep, expr = line.partition("=")
            if not sep or not re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*", name):
                raise ClassAdSyntaxError(f"not an attribute assignment: {line!r}")
            ad.set_expr(name.strip(), expr)
        return ad
