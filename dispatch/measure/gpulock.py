"""One sweep per GPU at a time: two processes timing one GPU contend for it and both record invalid timings.

The lock is an flock on <lock_dir()>/<GPU UUID>.lock (by UUID, since CUDA_VISIBLE_DEVICES renumbers devices),
so the kernel releases it when its holder dies. The holder writes its pid into the file for the refusal
message; the pid is informative only, the flock is the lock.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ...kernels.errors import EnvironmentProblem, InputError
from ..common.files import locked, naming
from ..common.paths import LOCKS_ENV, lock_dir

__all__ = ["LOCKS_ENV", "hold", "lock_dir"]


@contextlib.contextmanager
def hold(gpu_uuid: str, *, wait: bool = False) -> Iterator[Path]:
    """Hold the GPU's lock for the body; yields the lock file. Another holder makes this raise
    EnvironmentProblem naming its pid, or, with `wait`, block until it is gone."""
    if not re.fullmatch(r"[A-Za-z0-9-]+", gpu_uuid):
        raise InputError(f"GPU UUID {gpu_uuid!r} cannot name a lock file")
    folder = lock_dir()
    path = folder / f"{gpu_uuid}.lock"
    try:
        folder.mkdir(mode=0o1777, parents=True, exist_ok=True)
    except OSError as err:
        raise naming(err, folder) from None
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(locked(path, wait=False))
        except BlockingIOError:
            holder = path.read_text(errors="replace").strip() or "unknown"
            if not wait:
                raise EnvironmentProblem(f"GPU {gpu_uuid} is being timed by another sweep (pid {holder}, lock "
                                         f"{path}); wait for it to end or pass --wait") from None
            fd = stack.enter_context(locked(path))
        yield _claimed(fd, path)


def _claimed(fd: int, path: Path) -> Path:
    """Write this process's pid into the lock file it holds (informative only: the flock is the lock)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return path
