"""A directory only the agent's user can use: for the spool and the gate socket"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def private_directory(path: Path) -> None:
    """
    Make ``path`` a directory only the agent's user can use

    Missing directories (``path`` and its missing parents) are created with
    ``os.mkdir(..., 0o700)``, never wider, not even for a moment. An existing
    ``path`` must belong to the agent's user and be writable by nobody else;
    read or search access for others is then removed (mode 0700).

    :raises PermissionError: ``path`` belongs to another user, or others may
        write to it
    :raises OSError: ``path`` is not a directory or cannot be created
    """
    missing: list[Path] = []
    current = path
    while not os.path.lexists(current) and current.parent != current:
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    me = os.geteuid()
    if info.st_uid != me:
        raise PermissionError(
            f"directory {path} belongs to uid {info.st_uid}, not to the agent's uid {me}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise PermissionError(
            f"directory {path} is writable by group or others (mode {mode:04o}); refusing it"
        )
    if mode & 0o077:
        os.chmod(path, mode & 0o700)
