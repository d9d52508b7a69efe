"""The data-dir lock: one `mgr` per data directory, and the refusal says which process holds it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .private import DIR_MODE, FILE_MODE

LOCK_NAME = "mgr.lock"


class DataDirLocked(RuntimeError):
    """Another live `mgr` holds the data directory."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid else "another process"
        super().__init__(
            f"{data_dir} is in use by {holder} (another mgr); stop it first or pass a different "
            "--data-dir"
        )
        self.pid = pid


class DataDirLock:
    """An exclusive flock on `<data dir>/mgr.lock`, held for the life of the daemon.

    flock is released by the kernel when the holder dies, so a SIGKILLed daemon never leaves a
    stale lock behind; the pid written into the file only serves the error message.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        self.data_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirLocked(self.data_dir, self.holder_pid()) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def holder_pid(self) -> int | None:
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
