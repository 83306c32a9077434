"""Just enough of HTCondor's configuration language to run the emulator with the shipped startd"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from broker.emulation.errors import ConfigError

_REF_RE = re.compile(r"\$(ENV)?\(([A-Za-z0-9_.]+)(?::([^)]*))?\)")
_ASSIGN_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=(.*)$")
_INCLUDE_RE = re.compile(r"^\s*include\s*:\s*(.+?)\s*$", re.IGNORECASE)


class Config:
    """
    Configuration knobs, looked up case-insensitively with macro expansion

    Read as HTCondor does, from the file named by ``CONDOR_CONFIG``. Supported: ``NAME = value``
    (names case-insensitive, may carry a subsystem prefix such as ``MASTER.``), comments,
    ``\\`` line continuation, ``include : FILE`` (also ``include: FILE``), ``$(NAME)``,
    ``$(NAME:default)`` and ``$ENV(NAME)`` references. A value that refers to its own name
    (``START = ($(START)) && X``) sees the previous value, as in HTCondor; every other
    reference is expanded when the value is looked up.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.raw: dict[str, str] = {}
        self.environ = dict(os.environ if environ is None else environ)

    @classmethod
    def load(cls, path: Path, environ: Mapping[str, str] | None = None) -> Config:
        """
        Read ``path`` and the files it includes

        :raises ConfigError: a line is neither a comment, an assignment nor an include
        :raises OSError: a file cannot be read
        """
        config = cls(environ)
        config.read(path)
        return config

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Config:
        """
        The configuration named by ``CONDOR_CONFIG``

        :raises ConfigError: ``CONDOR_CONFIG`` is not set or the file is invalid
        """
        env = os.environ if environ is None else environ
        path = env.get("CONDOR_CONFIG")
        if not path:
            raise ConfigError("CONDOR_CONFIG is not set")
        try:
            return cls.load(Path(path), env)
        except OSError as err:
            raise ConfigError(f"cannot read {path}: {err}") from err

    def read(self, path: Path, depth: int = 0) -> None:
        if depth > 10:
            raise ConfigError(f"includes nested too deeply at {path}")
        lines = path.read_text().splitlines()
        index = 0
        while index < len(lines):
            line = lines[index]
            index += 1
            while line.rstrip().endswith("\\") and index < len(lines):
                line = line.rstrip()[:-1] + " " + lines[index].strip()
                index += 1
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            include = _INCLUDE_RE.match(line)
            if include:
                target = Path(self.expand(include.group(1)))
                if not target.is_absolute():
                    target = path.parent / target
                self.read(target, depth + 1)
                continue
            assign = _ASSIGN_RE.match(line)
            if not assign:
                raise ConfigError(f"{path}: cannot parse {line!r}")
            self.set(assign.group(1), assign.group(2).strip())

    def set(self, name: str, value: str) -> None:
        """Define ``name``; references to ``name`` itself take its previous value"""
        key = name.casefold()
        previous = self.raw.get(key)

        def self_reference(match: re.Match[str]) -> str:
            if match.group(1) or match.group(2).casefold() != key:
                return match.group(0)
            if previous is not None:
                return previous
            return match.group(3) if match.group(3) is not None else ""

        self.raw[key] = _REF_RE.sub(self_reference, value)

    def expand(self, text: str, depth: int = 0) -> str:
        if depth > 20:
            raise ConfigError(f"macro expansion too deep in {text!r}")

        def reference(match: re.Match[str]) -> str:
            if match.group(1):
                return self.environ.get(match.group(2), "")
            raw = self.raw.get(match.group(2).casefold())
            if raw is None:
                return match.group(3) if match.group(3) is not None else ""
            return self.expand(raw, depth + 1)

        return _REF_RE.sub(reference, text)

    def get(self, name: str, default: str | None = None, subsystem: str = "") -> str | None:
        """The expanded value of ``SUBSYSTEM.name`` or ``name``, else ``default``"""
        keys = ([f"{subsystem}.{name}".casefold()] if subsystem else []) + [name.casefold()]
        for key in keys:
            if key in self.raw:
                return self.expand(self.raw[key])
        return default

    def get_int(self, name: str, default: int, subsystem: str = "") -> int:
        value = self.get(name, subsystem=subsystem)
        try:
            return int(value) if value not in (None, "") else default
        except ValueError:
            return default

    def get_float(self, name: str, default: float, subsystem: str = "") -> float:
        value = self.get(name, subsystem=subsystem)
        try:
            return float(value) if value not in (None, "") else default
        except ValueError:
            return default

    def get_bool(self, name: str, default: bool, subsystem: str = "") -> bool:
        value = (self.get(name, subsystem=subsystem) or "").strip().casefold()
        if value in ("true", "yes", "1"):
            return True
        if value in ("false", "no", "0"):
            return False
        return default
