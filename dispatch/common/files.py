"""Atomic file writes and locks: a reader sees the old file or the whole new one, never a part.

An OSError from any step (read-only folder, disk full) is re-raised naming the destination path, not the
temp file, and leaves no temp file behind, so the command-line wrapper can print one line: path and cause.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def naming(err: OSError, path: Path) -> OSError:
    """`err` re-addressed to `path`: same type and errno, the cause kept as its text."""
    return type(err)(err.errno, err.strerror or str(err), str(path))


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable: a rename survives a power cut only once its folder is synced."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder (fsync, rename, fsync the folder)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise naming(err, path) from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; what we write is shared data
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise naming(err, path) from None
        raise


@contextlib.contextmanager
def locked(path: Path, *, shared: bool = False, wait: bool = True) -> Iterator[int]:
    """Hold an flock on `path` for the body and yield its descriptor: a folder is locked itself (no lock file to
    clutter it), any other path is a lock file, created if missing. The kernel drops the lock when its holder
    dies, so a killed command never leaves it held. With `wait` False a held lock raises BlockingIOError at
    once; an OSError opening the path names it."""
    try:
        fd = os.open(path, os.O_RDONLY) if path.is_dir() else os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise naming(err, path) from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        yield fd
    finally:
        os.close(fd)
