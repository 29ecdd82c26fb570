"""Timing harness: interleaved, raced, cold-L2 timing of launch callables (docs/architecture.md §4).

Generic over what is timed: a candidate is a `Launch` that enqueues one launch reading weight copy #i.
Everything above the `Backend` boundary is pure Python/numpy and is tested on a CPU with a fake
backend; `CupyBackend` is the only part that touches a GPU.

CuPy API used (checked against CuPy's cupy/cuda/stream.pyx, graph.pyx and cuda/__init__.py):
`Stream(non_blocking=True)`, `Stream.ptr` (0 = null, 1 = legacy, 2 = per-thread default),
`Stream.is_non_blocking`, `Stream.begin_capture(mode=None)` (relaxed mode by default),
`Stream.end_capture() -> Graph`, `Graph.launch(stream)` (the exec graph is destroyed when the Graph
object is collected; there is no explicit destroy), `Event()` (timing enabled), `Event.record(stream)`,
`Event.synchronize()`, `cupy.cuda.get_elapsed_time(start, stop)` in milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

import numpy as np

from ..common.contract import MODES, Mode

Launch = Callable[[int], None]  # enqueue ONE launch on the harness's stream, reading weight copy #i
Rotation = tuple[int, ...]  # the weight copies one window reads, in launch order

MAX_REPLAYS = 10_000  # a window never needs more; bounds graph size and capture time
_PROBES = 3  # calibration probes at most (each one re-aims at the target window)
_FIRST_PROBE = 16  # launches in the first calibration probe
_MAD_TO_SIGMA = 1.4826  # sigma of a normal distribution = 1.4826 x its MAD
_RACE_SIGMAS = 3.0  # half-width of a candidate's robust range, in sigmas


@dataclass(frozen=True)
class TimingConfig:
    mode: Mode = "graph"
    cold_l2: bool = True
    window_us: float = 200.0  # each timed window lasts at least ~this long (replays R chosen adaptively)
    warmup_rounds: int = 2
    min_rounds: int = 5  # rounds before racing may drop anything
    max_rounds: int = 25
    noise_rel: float = 0.02  # relative band inside which two medians are a tie
    race: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"timing mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.window_us > 0:
            raise ValueError(f"window_us must be > 0, got {self.window_us}")
        if self.warmup_rounds < 0 or self.min_rounds < 1 or self.max_rounds < self.min_rounds:
            raise ValueError(
                f"need warmup_rounds >= 0 and 1 <= min_rounds <= max_rounds, got {self.warmup_rounds}, "
                f"{self.min_rounds}, {self.max_rounds}"
            )
        if not self.noise_rel >= 0:
            raise ValueError(f"noise_rel must be >= 0, got {self.noise_rel}")


@dataclass(frozen=True)
class Stats:
    """Per-launch microseconds: each sample is window_elapsed / replays."""

    median_us: float
    p5_us: float
    p95_us: float
    mad_us: float  # raw median absolute deviation (not scaled to a sigma)
    n: int
    replays: int
    dropped: bool


class Window(Protocol):
    def run(self) -> float:
        """Run one timed window (one launch per entry of its rotation); return elapsed milliseconds."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    def prepare(self, launch: Launch, rotation: Rotation, mode: str) -> Window: ...


def copies_for_cold_l2(bytes_per_copy: int, l2_bytes: int, factor: float = 3.0) -> int:
    """Fewest weight copies whose rotation reads strictly more than factor x L2 (at least 2)."""
    if bytes_per_copy <= 0 or l2_bytes <= 0 or not factor > 0:
        raise ValueError(f"need positive sizes and factor, got {bytes_per_copy}, {l2_bytes}, {factor}")
    # Exact rational arithmetic: copies * bytes_per_copy > factor * l2_bytes, with no float rounding.
    return max(2, int(Fraction(factor) * l2_bytes // bytes_per_copy) + 1)


def cell_seed(*key: object) -> int:
    """Stable 64-bit seed from a cell key; repr of str/int tuples does not depend on PYTHONHASHSEED."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def _replays_for(per_launch_us: float, copies: int, window_us: float) -> int:
    """R so that R launches last >= window_us, at most MAX_REPLAYS; a multiple of copies once R >= copies,
    so a window that wraps around the copies reads each one equally often."""
    r = math.ceil(window_us / per_launch_us) if per_launch_us > 0 else MAX_REPLAYS
    r = max(1, min(r, MAX_REPLAYS))
    return math.ceil(r / copies) * copies if r >= copies else r


def rotations(copies: int, replays: int) -> list[Rotation]:
    """The windows a candidate cycles through, so that consecutive windows continue one rotation over the
    copies: a copy is read again only after every other copy was. With R >= copies one window covers whole
    rotations; with R < copies the copies are split into floor(copies / R) windows of near-equal length, each
    at least R long (small weights need thousands of copies to exceed 3x L2; a window need not read all)."""
    if replays >= copies:
        return [tuple(j % copies for j in range(replays))]
    parts = copies // replays
    return [tuple(range(g * copies // parts, (g + 1) * copies // parts)) for g in range(parts)]


def _calibrate(backend: Backend, launch: Launch, copies: int, config: TimingConfig) -> int:
    # A short probe over-estimates the per-launch time (event and launch overheads are amortized over
    # few launches), so re-probe at the proposed R until the proposal stops growing by more than 4x.
    replays = target = min(copies, _FIRST_PROBE)
    for _ in range(_PROBES):
        window = backend.prepare(launch, rotations(copies, replays)[0], config.mode)
        try:
            window.run()  # the first run pays one-time costs (graph upload, module load, clocks)
            per_launch_us = 1000.0 * window.run() / replays
        finally:
            window.close()
        target = _replays_for(per_launch_us, copies, config.window_us)
        if target <= 4 * replays:
            break
        replays = target
    return target


class _Cycle:
    """A candidate's windows, prepared on first use and run in turn, continuing the rotation."""

    def __init__(self, backend: Backend, launch: Launch, copies: int, replays: int, mode: str) -> None:
        self._backend, self._launch, self._mode = backend, launch, mode
        self._rotations = rotations(copies, replays)
        self._windows: list[Window | None] = [None] * len(self._rotations)
        self._next = 0

    def run(self) -> float:
        """Microseconds per launch in the next window."""
        g = self._next
        self._next = (g + 1) % len(self._rotations)
        if self._windows[g] is None:
            self._windows[g] = self._backend.prepare(self._launch, self._rotations[g], self._mode)
        return 1000.0 * self._windows[g].run() / len(self._rotations[g])

    def close(self) -> None:
        for w in self._windows:
            if w is not None:
                w.close()
        self._windows = [None] * len(self._windows)


def _stats(samples: list[float], replays: int, dropped: bool) -> Stats:
    x = np.asarray(samples, dtype=np.float64)
    median = float(np.median(x))
    p5, p95 = (float(v) for v in np.percentile(x, [5, 95]))
    mad = float(np.median(np.abs(x - median)))
    return Stats(median, p5, p95, mad, len(samples), replays, dropped)


def _beaten(samples: Mapping[str, list[float]], live: list[str], noise_rel: float) -> set[str]:
    """Racing rule: which live candidates are clearly beaten by the best (lowest median) one.

    A candidate's robust range is median +/- 3 sigma, sigma = 1.4826 x MAD (normal-consistent; MAD
    ignores outlier windows, which would block a p5/p95 rule). At n = 5 one candidate's MAD can be
    tiny by chance, so each MAD is floored by the pooled relative MAD of all live candidates (timed
    in the same interleaved rounds, they share the noise). A candidate is dropped when its range lies
    wholly above the best's range AND its median exceeds (1 + 2 noise_rel) x the best median, so
    nothing inside the tie band is ever dropped however tight the ranges are."""
    x = {c: np.asarray(samples[c], dtype=np.float64) for c in live}
    med = {c: float(np.median(v)) for c, v in x.items()}
    pooled_rel = float(
        np.median(np.concatenate([np.abs(v - med[c]) / max(med[c], 1e-12) for c, v in x.items()]))
    )
    half = {
        c: _RACE_SIGMAS * _MAD_TO_SIGMA * max(float(np.median(np.abs(v - med[c]))), pooled_rel * med[c])
        for c, v in x.items()
    }
    best = min(live, key=lambda c: (med[c], c))
    upper, limit = med[best] + half[best], (1.0 + 2.0 * noise_rel) * med[best]
    return {c for c in live if med[c] - half[c] > upper and med[c] > limit}


def time_candidates(
    launches: Mapping[str, Launch],
    copies: int,
    config: TimingConfig,
    backend: Backend | None = None,
    seed: int | None = None,
) -> dict[str, Stats]:
    """Time every candidate; interleaved rounds in a seeded shuffled order, raced when config.race."""
    if not launches:
        raise ValueError("time_candidates needs at least one candidate")
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    copies = copies if config.cold_l2 else 1  # hot L2: every launch reads the same copy
    backend = backend if backend is not None else CupyBackend()
    rng = np.random.default_rng(seed if seed is not None else cell_seed(config.seed))
    ids = sorted(launches)  # the caller's mapping order must not change the shuffles
    samples: dict[str, list[float]] = {c: [] for c in ids}
    replays: dict[str, int] = {}
    windows: dict[str, _Cycle] = {}
    live: list[str] = list(ids)
    dropped: set[str] = set()

    def shuffled(cands: list[str]) -> list[str]:
        return [cands[i] for i in rng.permutation(len(cands))]

    try:
        for c in ids:
            replays[c] = _calibrate(backend, launches[c], copies, config)
            windows[c] = _Cycle(backend, launches[c], copies, replays[c], config.mode)
        for _ in range(config.warmup_rounds):  # untimed: clocks, caches and allocators settle
            for c in shuffled(ids):
                windows[c].run()
        for rnd in range(1, config.max_rounds + 1):
            for c in shuffled(live):
                samples[c].append(windows[c].run())
            if config.race and rnd >= config.min_rounds:
                out = _beaten(samples, live, config.noise_rel) if len(live) > 1 else set()
                for c in sorted(out):
                    windows.pop(c).close()  # free its graph now; its stats stay
                dropped |= out
                live = [c for c in live if c not in out]
                if len(live) == 1:
                    break
    finally:
        for w in windows.values():
            w.close()
    return {c: _stats(samples[c], replays[c], c in dropped) for c in ids}


def _identity(x: str) -> Any:
    return x


def ties(stats: Mapping[str, Stats], noise_rel: float) -> list[str]:
    """Ids whose median is within noise_rel of the best median, sorted by id."""
    if not stats:
        raise ValueError("no candidates to compare")
    best = min(s.median_us for s in stats.values())
    return sorted(c for c, s in stats.items() if s.median_us <= best * (1.0 + noise_rel))


def winner(stats: Mapping[str, Stats], noise_rel: float, tiebreak: Callable[[str], Any] = _identity) -> str:
    """Best median; candidates inside the noise band of it are a tie, broken by tiebreak key then id."""
    return min(ties(stats, noise_rel), key=lambda c: (tiebreak(c), c))


class CupyBackend:
    """Times on ONE explicit non-blocking stream, with start/stop events recorded on it."""

    def __init__(self, stream: Any = None) -> None:
        import cupy  # lazily: the module must import on machines without CuPy

        self._cupy = cupy
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        # ptr 0/1/2 are the null, legacy and per-thread default streams; a blocking stream would
        # serialize with stream 0. docs/architecture.md §4: nothing is timed on stream 0.
        if self.stream.ptr in (0, 1, 2) or not self.stream.is_non_blocking:
            raise ValueError("CupyBackend needs an explicit non-blocking stream, not the default stream")

    def prepare(self, launch: Launch, rotation: Rotation, mode: str) -> Window:
        if mode == "graph":
            return _GraphWindow(self._cupy, self.stream, launch, rotation)
        if mode == "eager":
            return _EagerWindow(self._cupy, self.stream, launch, rotation)
        raise ValueError(f"timing mode must be 'graph' or 'eager', got {mode!r}")


class _EventTimer:
    def __init__(self, cupy: Any, stream: Any) -> None:
        self._cupy, self.stream = cupy, stream
        self._start, self._stop = cupy.cuda.Event(), cupy.cuda.Event()

    def time(self, enqueue: Callable[[], None]) -> float:
        self._start.record(self.stream)
        enqueue()
        self._stop.record(self.stream)
        self._stop.synchronize()
        return float(self._cupy.cuda.get_elapsed_time(self._start, self._stop))


class _EagerWindow(_EventTimer):
    """Launches issued back to back from the host: launch cost included, as an eager engine sees."""

    def __init__(self, cupy: Any, stream: Any, launch: Launch, rotation: Rotation) -> None:
        super().__init__(cupy, stream)
        self._launch, self._rotation = launch, rotation

    def _enqueue(self) -> None:
        with self.stream:  # the stream is current, so CuPy-issued launches land on it
            for i in self._rotation:
                self._launch(i)

    def run(self) -> float:
        return self.time(self._enqueue)

    def close(self) -> None:
        self._launch = _closed_launch


class _GraphWindow(_EventTimer):
    """The rotation's launches captured once into a CUDA graph; one graph launch per window."""

    def __init__(self, cupy: Any, stream: Any, launch: Launch, rotation: Rotation) -> None:
        super().__init__(cupy, stream)
        with stream:
            launch(rotation[0])  # once outside capture, so lazy compilation / module loading is not captured
            stream.synchronize()
            stream.begin_capture()
            try:
                for i in rotation:
                    launch(i)
            except BaseException:
                with contextlib.suppress(Exception):  # never leave the stream capturing
                    stream.end_capture()
                raise
            self._graph: Any = stream.end_capture()

    def run(self) -> float:
        if self._graph is None:
            raise RuntimeError("window is closed")
        return self.time(lambda: self._graph.launch(self.stream))

    def close(self) -> None:
        self._graph = None  # the exec graph is destroyed when CuPy's Graph object is collected


def _closed_launch(_: int) -> None:
    raise RuntimeError("window is closed")
