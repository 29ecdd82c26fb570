"""Timing harness tests: CPU-only through a fake backend, plus one GPU test that skips without CuPy."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from gemv_dispatch.dispatch.measure.timing import (
    MAX_REPLAYS,
    Launch,
    Stats,
    TimingConfig,
    _stats,
    cell_seed,
    copies_for_cold_l2,
    rotations,
    ties,
    time_candidates,
    winner,
)
from hypothesis import given
from hypothesis import strategies as st

MiB = 1 << 20


# --------------------------------------------------------------------------- the CPU test double
@dataclass(eq=False)
class FakeLaunch:
    """A candidate costing `cost_us` per launch; records the copy index of every launch."""

    name: str
    cost_us: float
    fail_at: int | None = None  # raise on this (0-based) call
    calls: list[int] = field(default_factory=list)

    def __call__(self, i: int) -> None:
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError(f"{self.name}: launch failed")
        self.calls.append(i)


class FakeWindow:
    """Graph mode 'captures' (calls the launches) at prepare; eager mode calls them on every run."""

    def __init__(self, backend: FakeBackend, launch: FakeLaunch, rotation: tuple[int, ...], mode: str):
        self.backend, self.launch, self.mode = backend, launch, mode
        self.rotation, self.replays = rotation, len(rotation)
        self.closed, self.returned_ms = False, []
        if mode == "graph":
            for i in rotation:
                launch(i)

    def run(self) -> float:
        assert not self.closed, "run on a closed window"
        b = self.backend
        if b.fail_on_run is not None and len(b.log) == b.fail_on_run:
            raise RuntimeError("launch failed (device fault)")
        if self.mode == "eager":
            for i in self.rotation:
                self.launch(i)
        noise = b.rng.lognormal(0.0, b.sigma) if b.sigma > 0 else 1.0
        if b.outlier_p > 0 and b.rng.random() < b.outlier_p:
            noise *= 3.0  # a preempted / throttled window
        ms = (self.replays * self.launch.cost_us * noise + b.overhead_us) / 1000.0
        b.log.append((self, self.launch.name))
        self.returned_ms.append(ms)
        return ms

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    def __init__(
        self,
        sigma: float = 0.01,
        seed: int = 0,
        overhead_us: float = 0.0,
        outlier_p: float = 0.0,
        fail_on_run: int | None = None,
    ):
        self.sigma, self.overhead_us, self.outlier_p = sigma, overhead_us, outlier_p
        self.fail_on_run = fail_on_run  # raise on this (0-based) window run, across all windows
        self.rng = np.random.default_rng(seed)
        self.windows: list[FakeWindow] = []
        self.log: list[tuple[FakeWindow, str]] = []

    def prepare(self, launch: Launch, rotation: tuple[int, ...], mode: str) -> FakeWindow:
        assert isinstance(launch, FakeLaunch)
        w = FakeWindow(self, launch, rotation, mode)
        self.windows.append(w)
        return w

    def timed_window(self, name: str) -> FakeWindow:
        """The last window prepared for a candidate is its timed one (earlier ones are probes)."""
        return [w for w in self.windows if w.launch.name == name][-1]


def fakes(**costs: float) -> dict[str, FakeLaunch]:
    return {name: FakeLaunch(name, cost) for name, cost in costs.items()}


def stats_of(median: float) -> Stats:
    return Stats(median, median, median, 0.0, 5, 1, False)


# --------------------------------------------------------------------------- statistics
def test_stats_on_known_samples() -> None:
    s = _stats([1.0, 2.0, 3.0, 4.0, 100.0], replays=7, dropped=True)
    assert (s.median_us, s.mad_us, s.n, s.replays, s.dropped) == (3.0, 1.0, 5, 7, True)
    assert s.p5_us == pytest.approx(np.percentile([1, 2, 3, 4, 100], 5))
    assert s.p95_us == pytest.approx(np.percentile([1, 2, 3, 4, 100], 95))


def test_stats_match_numpy_on_collected_samples() -> None:
    backend = FakeBackend(sigma=0.05, seed=3)
    cfg = TimingConfig(warmup_rounds=0, race=False, max_rounds=9, cold_l2=False)
    out = time_candidates(fakes(a=4.0, b=6.0), 1, cfg, backend=backend, seed=1)
    for name, s in out.items():
        w = backend.timed_window(name)
        x = 1000.0 * np.asarray(w.returned_ms) / w.replays  # per-launch microseconds
        assert s.n == len(x) == 9 and s.replays == w.replays and not s.dropped
        assert s.median_us == pytest.approx(np.median(x))
        assert s.p5_us == pytest.approx(np.percentile(x, 5))
        assert s.p95_us == pytest.approx(np.percentile(x, 95))
        assert s.mad_us == pytest.approx(np.median(np.abs(x - np.median(x))))


# --------------------------------------------------------------------------- replays and copies
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_replays_make_windows_last_window_us(mode: str) -> None:
    cfg = TimingConfig(mode=mode, cold_l2=False, warmup_rounds=0, max_rounds=5)
    out = time_candidates(fakes(a=3.7, b=0.9, c=450.0), 1, cfg, backend=FakeBackend(sigma=0.0))
    for name, cost in (("a", 3.7), ("b", 0.9)):
        r = out[name].replays
        assert r * cost >= cfg.window_us > (r - 1) * cost  # long enough, and no longer than needed
    assert out["c"].replays == 1  # one launch already exceeds the window


def test_calibration_reprobes_past_fixed_overhead() -> None:
    # 5 us of per-window overhead makes a 1-launch probe read 8.7 us; re-probing fixes the estimate.
    cfg = TimingConfig(cold_l2=False, window_us=200.0, max_rounds=5)
    out = time_candidates(fakes(a=3.7), 1, cfg, backend=FakeBackend(sigma=0.0, overhead_us=5.0))
    assert out["a"].replays * 3.7 >= 0.95 * cfg.window_us


def test_replays_clamped() -> None:
    cfg = TimingConfig(cold_l2=False, max_rounds=5)
    out = time_candidates(fakes(a=1e-4), 1, cfg, backend=FakeBackend(sigma=0.0))
    assert out["a"].replays == MAX_REPLAYS


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_cold_replays_are_whole_rotations_covering_all_copies(mode: str) -> None:
    backend = FakeBackend()
    launches = fakes(a=3.7, b=11.0)  # R >= copies for both
    cfg = TimingConfig(mode=mode, max_rounds=6)
    out = time_candidates(launches, 7, cfg, backend=backend)
    for name in launches:
        timed = backend.timed_window(name)
        assert out[name].replays % 7 == 0 and out[name].replays >= 7 and timed.replays == out[name].replays
        counts = Counter(timed.rotation)
        assert set(counts) == set(range(7))
        assert len(set(counts.values())) == 1  # every copy read equally often


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_many_copies_are_split_into_windows_that_continue_one_rotation(mode: str) -> None:
    """Small weights need thousands of copies to exceed 3x L2; a window reads R < copies of them and
    the next window continues where it stopped, so a copy is re-read only after all others were."""
    copies = 1000
    backend = FakeBackend(sigma=0.0)
    cfg = TimingConfig(mode=mode, warmup_rounds=1, race=False, max_rounds=30)
    out = time_candidates(fakes(a=3.7), copies, cfg, backend=backend)
    r = out["a"].replays
    assert r < copies and r * 3.7 >= cfg.window_us
    timed = [w for w, _ in backend.log if w.replays >= r]  # the timed windows (probes are shorter), in run order
    sequence = [i for w in timed for i in w.rotation]
    assert len(sequence) > copies, "the test must wrap around the rotation"
    assert sequence == [j % copies for j in range(len(sequence))]
    assert max(w.replays for w in timed) - min(w.replays for w in timed) <= 1  # near-equal windows, each >= R


def test_rotations_partition_the_copies() -> None:
    for copies, replays in ((10, 3), (1000, 54), (7, 7), (7, 21), (1, 5), (5, 1)):
        windows = rotations(copies, replays)
        flat = [i for w in windows for i in w]
        if replays >= copies:
            assert len(windows) == 1 and len(flat) == replays and Counter(flat) == Counter(
                {i: replays // copies for i in range(copies)})
        else:
            assert flat == list(range(copies)) and all(replays <= len(w) < 2 * replays for w in windows)


def test_hot_mode_uses_one_copy() -> None:
    backend = FakeBackend(sigma=0.0)
    launches = fakes(a=3.7)
    out = time_candidates(launches, 7, TimingConfig(cold_l2=False, max_rounds=5), backend=backend)
    assert all(set(w.rotation) == {0} for w in backend.windows) and set(launches["a"].calls) == {0}
    assert out["a"].replays == 55


def test_copies_for_cold_l2_examples() -> None:
    assert copies_for_cold_l2(MiB, 50 * MiB) == 151  # 151 MiB > 150 MiB, 150 MiB is not "exceeds"
    assert copies_for_cold_l2(MiB, 50 * MiB, factor=2.0) == 101
    assert copies_for_cold_l2(7 * MiB, 50 * MiB) == 22  # ceil(150 / 7) = 22
    assert copies_for_cold_l2(1 << 30, 50 * MiB) == 2  # one copy bigger than 3x L2 still rotates
    for bad in ((0, MiB), (MiB, 0), (-1, MiB)):
        with pytest.raises(ValueError):
            copies_for_cold_l2(*bad)
    with pytest.raises(ValueError):
        copies_for_cold_l2(MiB, MiB, factor=0.0)


@given(
    st.integers(1, 1 << 34),
    st.integers(1, 1 << 30),
    st.floats(0.5, 8.0, allow_nan=False),
)
def test_copies_for_cold_l2_is_the_fewest_that_exceed(b: int, l2: int, factor: float) -> None:
    from fractions import Fraction

    c = copies_for_cold_l2(b, l2, factor)
    target = Fraction(factor) * l2
    assert c >= 2 and c * b > target
    assert c == 2 or (c - 1) * b <= target


def test_cell_seed_is_stable() -> None:
    key = ("q4_0", 1, 4096, 4096, "graph")
    assert cell_seed(*key) == cell_seed(*key) == 7877447798975128995  # pinned: corpora depend on it
    assert cell_seed(*key) != cell_seed("q4_0", 2, 4096, 4096, "graph")
    assert 0 <= cell_seed() < 1 << 64


# --------------------------------------------------------------------------- interleaving
def round_orders(backend: FakeBackend, names: list[str], warmup: int) -> list[tuple[str, ...]]:
    timed = {backend.timed_window(n) for n in names}
    seq = [name for w, name in backend.log if w in timed][warmup * len(names) :]
    return [tuple(seq[i : i + len(names)]) for i in range(0, len(seq), len(names))]


def run_order(seed: int, reverse: bool = False) -> list[tuple[str, ...]]:
    names = ["a", "b", "c", "d", "e", "f"]
    backend = FakeBackend()
    launches = fakes(**{n: 5.0 for n in (reversed(names) if reverse else names)})
    cfg = TimingConfig(race=False, warmup_rounds=1, max_rounds=8)
    time_candidates(launches, 3, cfg, backend=backend, seed=seed)
    return round_orders(backend, names, warmup=1)


def test_order_shuffled_per_round_and_reproducible() -> None:
    orders = run_order(seed=11)
    assert len(orders) == 8 and all(sorted(o) == list("abcdef") for o in orders)
    assert len(set(orders)) > 1  # freshly shuffled every round
    assert run_order(seed=11) == orders  # same seed, same orders
    assert run_order(seed=11, reverse=True) == orders  # independent of the mapping's order
    assert run_order(seed=12) != orders


def test_default_seed_comes_from_config() -> None:
    def orders(cfg_seed: int) -> list[tuple[str, ...]]:
        backend = FakeBackend()
        cfg = TimingConfig(race=False, warmup_rounds=0, max_rounds=6, seed=cfg_seed)
        time_candidates(fakes(a=5.0, b=5.0, c=5.0, d=5.0), 1, cfg, backend=backend)
        return round_orders(backend, ["a", "b", "c", "d"], warmup=0)

    assert orders(0) == orders(0) != orders(1)


# --------------------------------------------------------------------------- racing
def test_racing_drops_a_clearly_slower_candidate() -> None:
    cfg = TimingConfig(max_rounds=25, min_rounds=5)
    out = time_candidates(fakes(a=10.0, b=20.0, c=10.05), 4, cfg, backend=FakeBackend(sigma=0.02))
    assert out["b"].dropped and cfg.min_rounds <= out["b"].n < cfg.max_rounds
    assert out["b"].median_us == pytest.approx(20.0, rel=0.05)  # dropped stats are kept
    assert not out["a"].dropped and not out["c"].dropped
    assert out["a"].n == out["c"].n == cfg.max_rounds


def test_racing_stops_when_one_candidate_is_left() -> None:
    cfg = TimingConfig(max_rounds=25, min_rounds=5)
    out = time_candidates(fakes(a=10.0, b=20.0), 1, cfg, backend=FakeBackend(sigma=0.01))
    assert out["b"].dropped and out["a"].n == out["b"].n == cfg.min_rounds
    single = time_candidates(fakes(a=10.0), 1, cfg, backend=FakeBackend())
    assert single["a"].n == cfg.min_rounds
    unraced = time_candidates(fakes(a=10.0, b=20.0), 1, TimingConfig(race=False), backend=FakeBackend())
    assert unraced["a"].n == unraced["b"].n == 25 and not unraced["b"].dropped


@pytest.mark.parametrize(("sigma", "outlier_p"), [(0.01, 0.02), (0.02, 0.0)])
def test_racing_never_drops_candidates_within_noise(sigma: float, outlier_p: float) -> None:
    # Four candidates at most 1.5% apart (inside noise_rel = 2%), jittered windows, some 3x outliers.
    cfg = TimingConfig(max_rounds=12, min_rounds=5, noise_rel=0.02)
    dropped_seeds = []
    for seed in range(200):
        backend = FakeBackend(sigma=sigma, seed=seed, outlier_p=outlier_p)
        out = time_candidates(fakes(a=10.0, b=10.1, c=10.15, d=10.0), 2, cfg, backend=backend, seed=seed)
        if any(s.dropped or s.n != cfg.max_rounds for s in out.values()):
            dropped_seeds.append(seed)
    assert dropped_seeds == []


# --------------------------------------------------------------------------- winner and ties
def test_ties_and_deterministic_tiebreak() -> None:
    stats = {"k3": stats_of(10.19), "k1": stats_of(10.1), "k2": stats_of(10.0), "k0": stats_of(11.0)}
    assert ties(stats, 0.02) == ["k1", "k2", "k3"]  # 10.19 <= 10.2; 11.0 is out of the band
    assert winner(stats, 0.02) == "k1"  # default tiebreak: id
    prefer = {"k1": 2, "k2": 1, "k3": 1, "k0": 0}
    assert winner(stats, 0.02, tiebreak=prefer.__getitem__) == "k2"  # key, then id
    assert winner(dict(reversed(stats.items())), 0.02, tiebreak=prefer.__getitem__) == "k2"
    assert winner(stats, 0.0) == "k2"  # no band: the best median alone


def test_clear_winner_ignores_tiebreak() -> None:
    stats = {"slow": stats_of(12.0), "fast": stats_of(10.0)}
    assert ties(stats, 0.02) == ["fast"]
    assert winner(stats, 0.02, tiebreak=lambda c: 0 if c == "slow" else 1) == "fast"
    with pytest.raises(ValueError):
        ties({}, 0.02)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_negative_control_faster_candidate_wins_and_swaps(mode: str) -> None:
    cfg = TimingConfig(mode=mode)
    for fast, slow in (("x", "y"), ("y", "x")):
        out = time_candidates(
            {fast: FakeLaunch(fast, 9.0), slow: FakeLaunch(slow, 10.0)},
            3,
            cfg,
            backend=FakeBackend(sigma=0.02, seed=5),
        )
        assert winner(out, cfg.noise_rel) == fast
        assert ties(out, cfg.noise_rel) == [fast]


# --------------------------------------------------------------------------- failures
@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize(
    ("fail_at", "fail_on_run"),
    [(0, None), (3, None), (None, 1), (None, 15)],  # capture/probe launch, probe run, a timed round
)
def test_windows_closed_when_a_launch_raises(mode: str, fail_at: int | None, fail_on_run: int | None) -> None:
    backend = FakeBackend(fail_on_run=fail_on_run)
    launches = {"a": FakeLaunch("a", 10.0), "b": FakeLaunch("b", 5.0, fail_at=fail_at)}
    with pytest.raises(RuntimeError, match="launch failed"):
        time_candidates(launches, 2, TimingConfig(mode=mode), backend=backend)
    assert backend.windows and all(w.closed for w in backend.windows)
    if fail_on_run == 15:  # 8 probe runs and 4 warm-up runs came first: this was a timed round
        assert len(backend.log) == 15


def test_bad_arguments_rejected() -> None:
    with pytest.raises(ValueError, match="at least one"):
        time_candidates({}, 1, TimingConfig(), backend=FakeBackend())
    with pytest.raises(ValueError, match="copies"):
        time_candidates(fakes(a=1.0), 0, TimingConfig(), backend=FakeBackend())
    for bad in (
        {"mode": "lazy"},
        {"window_us": 0.0},
        {"min_rounds": 0},
        {"min_rounds": 9, "max_rounds": 3},
        {"noise_rel": -0.1},
        {"warmup_rounds": -1},
    ):
        with pytest.raises(ValueError):
            TimingConfig(**bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cupy_backend_times_a_bigger_copy_as_slower() -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        n_devices = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        pytest.skip(f"no CUDA device: {err}")
    if n_devices == 0:
        pytest.skip("no CUDA device")
    from gemv_dispatch.dispatch.measure.timing import CupyBackend

    with pytest.raises(ValueError, match="non-blocking"):
        CupyBackend(cupy.cuda.Stream.null)
    backend = CupyBackend()
    l2 = cupy.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    copies = copies_for_cold_l2(8 * MiB, l2)
    copy = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x", "timing_test_copy")

    def make(nbytes: int) -> Launch:
        with backend.stream:
            srcs = [cupy.full(nbytes // 4, i, dtype=cupy.float32) for i in range(copies)]
            dst = cupy.empty(nbytes // 4, dtype=cupy.float32)
        backend.stream.synchronize()

        def launch(i: int) -> None:
            with backend.stream:
                copy(srcs[i], dst)

        return launch

    launches = {"big": make(64 * MiB), "small": make(8 * MiB)}
    for mode in ("graph", "eager"):
        cfg = TimingConfig(mode=mode)
        out = time_candidates(launches, copies, cfg, backend=backend, seed=cell_seed("gpu-test", mode))
        for s in out.values():
            values = (s.median_us, s.p5_us, s.p95_us)
            assert all(np.isfinite(v) and v > 0 for v in values) and np.isfinite(s.mad_us)
            assert (s.replays % copies == 0 or s.replays < copies) and s.n >= cfg.min_rounds
        assert out["big"].median_us > 1.2 * out["small"].median_us, out
        assert winner(out, cfg.noise_rel) == "small"
        print(mode, copies, out)
