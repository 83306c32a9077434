"""
Every exception class of the emulators (``broker/emulation/``)

The tree::

    EmulationError
    ├── EmulatorUnavailable     nobody answers on an emulator's socket
    ├── SlurmUnavailable        the real Slurm cannot start (a program missing, a daemon failed)
    ├── ConfigError             an HTCondor configuration line it cannot read (a ValueError)
    └── ClassAdSyntaxError      a ClassAd expression it cannot parse (a ValueError)
"""

from __future__ import annotations


class EmulationError(Exception):
    """Base for everything the emulators raise on purpose"""


class EmulatorUnavailable(EmulationError):
    """Nobody answers on the emulator's socket"""


class SlurmUnavailable(EmulationError):
    """The real Slurm cannot start: a program is missing or a daemon failed (with its logs)"""


class ConfigError(EmulationError, ValueError):
    """A configuration line the emulator does not understand"""


class ClassAdSyntaxError(EmulationError, ValueError):
    """An expression the emulator cannot parse"""
