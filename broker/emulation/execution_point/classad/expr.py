"""The ClassAd expression language of the emulated startd: values, parser, operators"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from broker.emulation.errors import ClassAdSyntaxError

if TYPE_CHECKING:
    from broker.emulation.execution_point.classad.ad import Scope


class _Undefined:
    def __repr__(self) -> str:
        return "undefined"


class _Error:
    def __repr__(self) -> str:
        return "error"


UNDEFINED = _Undefined()
ERROR = _Error()
Value = Union[bool, int, float, str, _Undefined, _Error]  # noqa: UP007 (runtime alias)


_TOKEN_RE = re.compile(
    r"""\s*(?:
        (?P<real>\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
      | (?P<int>\d+)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)
      | (?P<op>=\?=|=!=|==|!=|<=|>=|&&|\|\||[-+*/%<>!?:(),])
    )""",
    re.VERBOSE,
)


def _old_string_end(text: str, pos: int) -> int:
    """
    Where the old-syntax string literal starting at ``text[pos]`` ends (after its quote)

    Old ClassAd syntax (HTCondor's config files and ``-long`` lines): a
    backslash is an ordinary character, but ``\\"`` is a quote inside the
    string unless it ends the expression.
    """
    at = pos + 1
    while True:
        quote_at = text.find('"', at)
        if quote_at < 0:
            raise ClassAdSyntaxError(f"unterminated string in {text!r}")
        if text[quote_at - 1] != "\\" or quote_at == at or quote_at == len(text) - 1:
            return quote_at + 1
        at = quote_at + 1


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        start = len(text) - len(text[pos:].lstrip())
        if start < len(text) and text[start] == '"':
            pos = _old_string_end(text, start)
            out.append(("str", text[start:pos]))
            continue
        match = _TOKEN_RE.match(text, pos)
        if not match or match.end() == pos:
            raise ClassAdSyntaxError(f"cannot parse {text!r} at {text[pos:]!r}")
        kind = match.lastgroup or ""
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class Node:
    """A parsed expression"""

    def eval(self, scope: Scope) -> Value:
        raise NotImplementedError


@dataclass(frozen=True)
class Literal(Node):
    value: Value

    def eval(self, scope: Scope) -> Value:
        return self.value


@dataclass(frozen=True)
class Attr(Node):
    name: str

    def eval(self, scope: Scope) -> Value:
        return scope.lookup(self.name)


@dataclass(frozen=True)
class Unary(Node):
    op: str
    operand: Node

    def eval(self, scope: Scope) -> Value:
        value = self.operand.eval(scope)
        if value is ERROR or value is UNDEFINED:
            return value
        if self.op == "!":
            return (not value) if isinstance(value, bool) else ERROR
        if isinstance(value, bool) or not isinstance(value, int | float):
            return ERROR
        return -value if self.op == "-" else value


@dataclass(frozen=True)
class Binary(Node):
    op: str
    left: Node
    right: Node

    def eval(self, scope: Scope) -> Value:
        if self.op == "&&":
            return _and(self.left.eval(scope), lambda: self.right.eval(scope))
        if self.op == "||":
            return _or(self.left.eval(scope), lambda: self.right.eval(scope))
        left, right = self.left.eval(scope), self.right.eval(scope)
        if self.op in ("=?=", "=!="):
            same = type(left) is type(right) and left == right
            return same if self.op == "=?=" else not same
        if left is ERROR or right is ERROR:
            return ERROR
        if left is UNDEFINED or right is UNDEFINED:
            return UNDEFINED
        return _compare_or_compute(self.op, left, right)


@dataclass(frozen=True)
class Conditional(Node):
    test: Node
    then: Node
    otherwise: Node

    def eval(self, scope: Scope) -> Value:
        test = self.test.eval(scope)
        if test is UNDEFINED or test is ERROR:
            return test
        if not isinstance(test, bool):
            return ERROR
        return self.then.eval(scope) if test else self.otherwise.eval(scope)


@dataclass(frozen=True)
class Call(Node):
    name: str
    args: tuple[Node, ...]

    def eval(self, scope: Scope) -> Value:
        name = self.name.casefold()
        if name == "time" and not self.args:
            return int(time.time())
        if name == "ifthenelse" and len(self.args) == 3:
            return Conditional(*self.args).eval(scope)
        if name == "isundefined" and len(self.args) == 1:
            return self.args[0].eval(scope) is UNDEFINED
        if name == "iserror" and len(self.args) == 1:
            return self.args[0].eval(scope) is ERROR
        return ERROR


def _and(left: Value, right: Callable[[], Value]) -> Value:
    if left is False:
        return False
    if left is ERROR or not (isinstance(left, bool) or left is UNDEFINED):
        return ERROR
    value = right()
    if value is False:
        return False
    if value is ERROR or not (isinstance(value, bool) or value is UNDEFINED):
        return ERROR
    return UNDEFINED if UNDEFINED in (left, value) else True


def _or(left: Value, right: Callable[[], Value]) -> Value:
    if left is True:
        return True
    if left is ERROR or not (isinstance(left, bool) or left is UNDEFINED):
        return ERROR
    value = right()
    if value is True:
        return True
    if value is ERROR or not (isinstance(value, bool) or value is UNDEFINED):
        return ERROR
    return UNDEFINED if UNDEFINED in (left, value) else False


def _compare_or_compute(op: str, left: Value, right: Value) -> Value:
    if isinstance(left, str) and isinstance(right, str):
        a, b = left.casefold(), right.casefold()
        comparisons = {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b}
        if op in comparisons:
            return comparisons[op]
        return (a >= b) if op == ">=" else ERROR
    if isinstance(left, bool) and isinstance(right, bool) and op in ("==", "!="):
        return (left == right) if op == "==" else (left != right)
    numeric = (int, float)
    if (
        isinstance(left, bool)
        or isinstance(right, bool)
        or not isinstance(left, numeric)
        or not isinstance(right, numeric)
    ):
        return ERROR
    if op == "==":
        return left == right
    if op == "!=":
        return left != right
    if op == "<":
        return left < right
    if op == "<=":
        return left <= right
    if op == ">":
        return left > right
    if op == ">=":
        return left >= right
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if right == 0:
        return ERROR
    if op == "/":
        return left // right if isinstance(left, int) and isinstance(right, int) else left / right
    return left % right


class _Parser:
    _LEVELS = (("||",), ("&&",), ("==", "!=", "=?=", "=!="), ("<", "<=", ">", ">="))

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise ClassAdSyntaxError(f"expected {value or 'more'} in {self.text!r}")
        self.pos += 1
        return token

    def at_op(self, *ops: str) -> str | None:
        token = self.peek()
        if token and token[0] in ("op", "name") and token[1].casefold() in ops:
            return token[1].casefold()
        return None

    def parse(self) -> Node:
        node = self.conditional()
        if self.peek() is not None:
            raise ClassAdSyntaxError(f"unexpected {self.peek()} in {self.text!r}")
        return node

    def conditional(self) -> Node:
        test = self.binary(0)
        if self.at_op("?"):
            self.take("?")
            then = self.conditional()
            self.take(":")
            return Conditional(test, then, self.conditional())
        return test

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.additive()
        node = self.binary(level + 1)
        ops = self._LEVELS[level] + (("is", "isnt") if level == 2 else ())
        while op := self.at_op(*ops):
            self.pos += 1
            op = {"is": "=?=", "isnt": "=!="}.get(op, op)
            node = Binary(op, node, self.binary(level + 1))
        return node

    def additive(self) -> Node:
        node = self.multiplicative()
        while op := self.at_op("+", "-"):
            self.pos += 1
            node = Binary(op, node, self.multiplicative())
        return node

    def multiplicative(self) -> Node:
        node = self.unary()
        while op := self.at_op("*", "/", "%"):
            self.pos += 1
            node = Binary(op, node, self.unary())
        return node

    def unary(self) -> Node:
        if op := self.at_op("!", "-", "+"):
            self.pos += 1
            return Unary(op, self.unary())
        return self.primary()

    def primary(self) -> Node:
        kind, text = self.take()
        if kind == "int":
            return Literal(int(text))
        if kind == "real":
            return Literal(float(text))
        if kind == "str":
            return Literal(_unescape(text[1:-1]))
        if kind == "op" and text == "(":
            node = self.conditional()
            self.take(")")
            return node
        if kind == "name":
            folded = text.casefold()
            keywords: dict[str, Value] = {
                "true": True,
                "false": False,
                "undefined": UNDEFINED,
                "error": ERROR,
            }
            if folded in keywords:
                return Literal(keywords[folded])
            if self.at_op("("):
                self.take("(")
                args: list[Node] = []
                while not self.at_op(")"):
                    args.append(self.conditional())
                    if not self.at_op(")"):
                        self.take(",")
                self.take(")")
                return Call(text, tuple(args))
            return Attr(text)
        raise ClassAdSyntaxError(f"unexpected {text!r} in {self.text!r}")


def _unescape(body: str) -> str:
    """The value of an old-syntax string literal's body (see :func:`_old_string_end`)"""
    return body.replace('\\"', '"')


def parse(text: str) -> Node:
    """
    One expression

    Supported: literals (integers, reals, strings, ``true``/``false``/``undefined``/
    ``error``), attribute references (``MY.`` and ``TARGET.`` scopes), ``!``, unary
    ``-``, ``* / %``, ``+ -``, comparisons, ``==``/``!=`` (case-insensitive on
    strings), ``=?=``/``=!=`` (``is``/``isnt``), ``&&``, ``||``, ``?:``, and the
    functions ``time()``, ``ifThenElse``, ``isUndefined``, ``isError``. Logic is
    three-valued as in HTCondor: ``undefined && false`` is ``false``.

    :raises ClassAdSyntaxError: not in the supported subset
    """
    return _Parser(text).parse()
