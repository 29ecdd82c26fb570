"""Atomic file writes and locks: a reader sees the old file or the whole new one, never a part.

An OSError from any step (read-only folder, disk full) is re-raised naming the destination path, not the
temp file, and leaves no temp file behind, so the command-line wrapper can print one line: path and cause.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from ...kernels.errors import InputError


def naming(err: OSError, path: Path) -> OSError:
    """`err` re-addressed to `path`: same type and errno, the cause kept as its text."""
    return type(err)(err.errno, err.strerror or str(err), str(path))


def read_input(path: Path, what: str, hint: str = "") -> bytes:
    """The bytes of a file a user named; InputError, one line, for a missing path or a folder where the file
    should be (an input mistake, not a problem of the machine). `hint` follows "no such ... file"."""
    try:
        return Path(path).read_bytes()
    except IsADirectoryError:
        raise InputError(f"{path}: a folder, not a {what} file") from None
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{path}: no such {what} file{hint}") from None


def check_output(path: Path, what: str) -> None:
    """InputError unless `path` can name a file to write: not a folder, in a folder that exists. Run before the
    work whose result it receives, so a mistyped -o costs no minutes of work."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: a folder; name the {what} file to write")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent}: no such folder to write the {what} file {path.name} into")


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable: a rename survives a power cut only once its folder is synced."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staged(path: Path, data: bytes) -> str:
    """A synced temp file in `path`'s folder holding `data`; an OSError names `path` and leaves no temp file."""
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
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise naming(err, path) from None
        raise
    return tmp


def write_files(folder: Path, files: Mapping[str, bytes]) -> None:
    """Write every file of `files` ({name: bytes}) into `folder`, each atomically (temp file in the folder,
    fsync, rename, fsync the folder), and every one staged before the first is renamed into place: a full disk
    or a read-only folder fails before any file changes, and a kill between the renames leaves each file whole,
    old or new (a table folder's certificate then refuses the mix)."""
    if not files:
        return
    staged: dict[Path, str] = {}  # what is still to rename (and to remove, should anything fail)
    try:
        for name, data in files.items():
            staged[folder / name] = _staged(folder / name, data)
        for path, tmp in list(staged.items()):
            try:
                os.replace(tmp, path)
            except OSError as err:
                raise naming(err, path) from None
            del staged[path]
        try:
            fsync_dir(folder)
        except OSError as err:
            raise naming(err, path) from None
    finally:
        for tmp in staged.values():
            Path(tmp).unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder (fsync, rename, fsync the folder)."""
    write_files(path.parent, {path.name: data})


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
