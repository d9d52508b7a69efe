"""The data dir is for its owner's eyes only: it holds the control token, the engines' API keys (in
the database's flags) and the engines' logs.

What the daemon creates there is made private as it is created (folders 0700, files 0600); at start
the whole tree is tightened too, for a data dir an older moelab left readable by everyone.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def make_private(folder: Path) -> None:
    """Create `folder` (0700) if needed and take every permission of group and others away from
    it and from everything under it. Symbolic links are neither followed nor changed."""
    folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(folder, DIR_MODE)
    for parent, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            path = os.path.join(parent, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & _OTHERS:
                os.chmod(path, stat.S_IMODE(mode) & ~_OTHERS)


def create_private_file(path: Path) -> None:
    """Make sure `path` exists with mode 0600 (created so, or tightened when it was not)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
