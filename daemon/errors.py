"""Errors a client can cause, each with the HTTP status and code the API answers with."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
from pathlib import Path

from ..engine.text import Text

# less free than this, and an I/O error of SQLite is taken for a full disk (its -shm file alone
# needs 32 KiB)
NEARLY_FULL_BYTES = 1024**2


class ApiError(Exception):
    """A refusal the API turns into `{"error": {"message", "code"}}` with `status`.

    The message is a Text (engine/text.py): the API answers its English, with its stored form
    beside it; the console shows it in the viewer's language.
    """

    status = 400
    code = "bad_request"

    def __init__(
        self,
        message: Text | str,
        *,
        code: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(str(message))
        self.text = message
        self.message = str(message)
        self.headers = headers
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class BadRequest(ApiError):
    status = 400
    code = "bad_request"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class DiskFull(ApiError):
    """A write failed for want of space: the same request succeeds once space is freed."""

    status = 507
    code = "disk_full"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        free = _free_bytes(path)
        if free is None:
            message = Text(
                "mgr could not write: the disk holding {path} is full. Free some space on it and "
                "try again; reading works meanwhile.",
                path=self.path,
            )
        else:
            message = Text(
                "mgr could not write: the disk holding {path} is full ({free_mib:.1f} MiB left). "
                "Free some space on it and try again; reading works meanwhile.",
                path=self.path,
                free_mib=free / 1024**2,
            )
        super().__init__(message)


def disk_full(err: BaseException | None, path: str | os.PathLike) -> DiskFull | None:
    """A DiskFull when `err`, or an error it came from, says the disk is full; it names the
    file an OSError names, else `path` (what was being written: the database, the data dir)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DiskFull):
            return err
        code = getattr(err, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL or (
            # SQLite says only "disk I/O error" where it cannot make its -shm or -wal file
            code is not None and code & 0xFF == sqlite3.SQLITE_IOERR and _nearly_full(path)
        ):
            return DiskFull(path)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull(err.filename or path)
        err = err.__cause__ or err.__context__
    return None


def _free_bytes(path: str | os.PathLike) -> int | None:
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def _nearly_full(path: str | os.PathLike) -> bool:
    free = _free_bytes(path)
    return free is not None and free < NEARLY_FULL_BYTES
