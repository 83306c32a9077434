"""Subcommands whose arguments are added only when one of them runs

Their defaults come from the code they drive, so adding them imports that
code: ``agent run`` on a drone must not pay for the manager's commands.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

#: adds a command's arguments (or its own subcommands) to its parser
Fill = Callable[[argparse.ArgumentParser], None]


if TYPE_CHECKING:
    _SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:  # not subscriptable at run time
    _SubParsers = argparse._SubParsersAction


class Commands(_SubParsers):
    """A subparsers action that fills a command's parser when argparse picks it"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unfilled: dict[str, tuple[Fill, argparse.ArgumentParser]] = {}

    def add_command(self, name: str, fill: Fill, **kwargs: Any) -> None:
        """Add the command ``name`` (``kwargs`` as for ``add_parser``), filled later"""
        self._unfilled[name] = (fill, self.add_parser(name, **kwargs))

    def fill(self, name: str | None = None) -> None:
        """Fill the parser of command ``name``, or of every command"""
        for key in list(self._unfilled) if name is None else [name]:
            if key in self._unfilled:
                fill, parser = self._unfilled.pop(key)
                fill(parser)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list)  # nargs=PARSER: the command, then its arguments
        self.fill(values[0])
        with self.parsing(self.choices[values[0]], namespace):
            super().__call__(parser, namespace, values, option_string)

    def parsing(
        self, command: argparse.ArgumentParser, namespace: argparse.Namespace
    ) -> contextlib.AbstractContextManager[None]:
        """What surrounds the parsing of ``command``'s arguments into ``namespace``; nothing here"""
        return contextlib.nullcontext()
