"""
Reading and writing HTCondor's long-form ClassAds (``Attr = value`` lines, old syntax)

Lenient and evaluating nothing: a line that is not an assignment is skipped, a value that
is not a literal is kept as its expression text. Free of heavy imports: the job hooks
import it on every payload start.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

#: an attribute assignment; names may carry a scope (``MY.Foo``) or dots
_LINE_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*(.*?)\s*$")
_INT_RE = re.compile(r"^[+-]?\d+$")
_LINE_BREAK_RE = re.compile(r"\r\n|\r|\n")
_REAL_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


class Expr(str):
    """A value that is not a literal, kept as its ClassAd expression text"""

    __slots__ = ()


#: a parsed value; ``None`` is ClassAd ``undefined``
Value = str | int | float | bool | Expr | None


class ClassAd(Mapping[str, Value]):
    """One ad; attribute names are case-insensitive, as in HTCondor"""

    def __init__(self, items: Mapping[str, Value] | None = None) -> None:
        self._items: dict[str, tuple[str, Value]] = {}
        for name, value in (items or {}).items():
            self[name] = value

    def __setitem__(self, name: str, value: Value) -> None:
        self._items[name.casefold()] = (name, value)

    def __getitem__(self, name: str) -> Value:
        return self._items[name.casefold()][1]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.casefold() in self._items

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"ClassAd({dict(self.items())!r})"

    def string(self, name: str) -> str | None:
        """The attribute as a string, if it is one"""
        value = self.get(name)
        return value if isinstance(value, str) and not isinstance(value, Expr) else None

    def integer(self, name: str) -> int | None:
        """The attribute as an integer (also from an integral real or a digit string)"""
        value = self.get(name)
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return int(value) if value.is_integer() else None
        if _INT_RE.match(value.strip()):
            return int(value)
        return None

    def real(self, name: str) -> float | None:
        """The attribute as a number"""
        value = self.get(name)
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int | float):
            return float(value)
        try:
            return float(value)
        except ValueError:
            return None

    def boolean(self, name: str) -> bool | None:
        """The attribute as a boolean (``true``/``false``, case-insensitive)"""
        value = self.get(name)
        return value if isinstance(value, bool) else None


def _unquote(text: str) -> str | None:
    """
    The string literal ``"..."`` as its value, or ``None`` if it is not exactly one

    Old ClassAd syntax, as HTCondor prints and reads ``Attr = value`` lines
    (its ``Lexer::tokenizeStringOld``): a backslash is an ordinary character,
    except that ``\\"`` is a quote inside the string, unless that quote ends
    the value (then the string ends with a backslash).
    """
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return None
    out: list[str] = []
    start, last = 1, len(text) - 1
    while True:
        quote_at = text.find('"', start)
        chunk = text[start:quote_at]
        if not chunk.endswith("\\") or quote_at == last:
            out.append(chunk)
            break
        out.append(chunk[:-1] + '"')  # an escaped quote; the string goes on
        start = quote_at + 1
    if quote_at != last:
        return None  # more after the string: an expression such as "a" + "b"
    return "".join(out)


def parse_value(text: str) -> Value:
    """One value as HTCondor prints it; anything that is not a literal becomes :class:`Expr`"""
    text = text.strip()
    folded = text.casefold()
    if folded == "true":
        return True
    if folded == "false":
        return False
    if folded == "undefined":
        return None
    if _INT_RE.match(text):
        return int(text)
    if _REAL_RE.match(text):
        return float(text)
    unquoted = _unquote(text)
    if unquoted is not None:
        return unquoted
    return Expr(text)


def parse_ads(text: str) -> list[ClassAd]:
    """
    All ads in ``text``; blank lines separate ads

    Lines that are not ``Attr = value`` (banners, ``[``/``]`` of the new syntax,
    comments) are skipped, so a garbled line loses one attribute, not the ad.
    """
    ads: list[ClassAd] = []
    current = ClassAd()
    for line in text.split("\n"):  # HTCondor ends lines at \n only
        if not line.strip():
            if current:
                ads.append(current)
                current = ClassAd()
            continue
        match = _LINE_RE.match(line)
        if match:
            current[match.group(1)] = parse_value(match.group(2))
    if current:
        ads.append(current)
    return ads


def parse_ad(text: str) -> ClassAd:
    """One ad from ``text``, ignoring blank lines (as a hook's stdin is one ad)"""
    ad = ClassAd()
    for found in parse_ads(text):
        for name, value in found.items():
            ad[name] = value
    return ad


def quote(text: str) -> str:
    """
    ``text`` as an old-syntax ClassAd string literal on one line

    Quotes become ``\\"``; backslashes stay as they are (see :func:`_unquote`).
    Old syntax has no way to write a line break inside a string, so line
    breaks become spaces.
    """
    return '"' + _LINE_BREAK_RE.sub(" ", text).replace('"', '\\"') + '"'
