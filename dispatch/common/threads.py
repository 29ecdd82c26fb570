"""How many native threads (OpenMP, BLAS) the learning stages may use.

scikit-learn's gradient boosting runs thousands of short OpenMP parallel regions per fit, each ending at a
barrier. When other processes keep the cores busy, a barrier waits for whichever thread the scheduler has
parked, so a pool as wide as the machine runs many times slower than one thread (measured on two shared
cores: a time-model fit 5-25x slower with two threads than with one). The pool is therefore sized to the
cores that are free: the cores this process may run on (its affinity, not the machine's count), less the
ones the load average says other work is holding, and at least one. OMP_NUM_THREADS, when set, decides
instead. The thread count never changes a result (the fits are deterministic for any count; the committed
policy reproduces byte for byte either way)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """Cores this process may be scheduled on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity (macOS)
        return os.cpu_count() or 1


def thread_budget(cores: int | None = None, load: float | None = None) -> int:
    """Threads for a native pool: $OMP_NUM_THREADS when it is a positive integer, else the usable cores less
    the busy ones (1-minute load average, rounded), at least 1."""
    given = os.environ.get(ENV, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average to read: assume the cores are free
            load = 0.0
    return max(1, min(cores, cores - round(load)))


@contextmanager
def bounded_threads() -> Iterator[int]:
    """Limit OpenMP and BLAS pools to thread_budget() inside the block; yields the limit."""
    from threadpoolctl import threadpool_limits  # a scikit-learn dependency

    limit = thread_budget()
    with threadpool_limits(limits=limit):
        yield limit
