"""Certification (docs/policy.md §7): prove a dispatch table keeps every result byte-identical to serial M=1 decode.

One named, seeded check per property, shared by `certify`, `check` and the tests (the scikit-learn
`estimator_checks` pattern: each check is a plain function a test can run alone against a broken table or a
broken device to see it fail):

    selection              every key gets a valid candidate; its identity is the same for every M and mode
    grouped_equals_serial  the dispatched grouped launch == M serial dispatched M=1 launches, byte for byte
    repeat_identical       launching the same key again gives the same bytes
    permutation            permuted activation rows give exactly the permuted output rows
    poison                 every output element was written (outputs start as a NaN pattern no kernel writes)
    emulator_equality      device bytes == the CPU emulator's, for a key of every codebook x identity x engine
    negative_control       two different identities on random data compare as different (the checks can fail)
    spill_free             every kernel instantiation the table launches compiles without spills (nvcc)

Bytes are compared as uint32 patterns, so +0/−0 and NaN payloads are distinct values.

Keys: every (codebook, N, K) of the corpus the policy was trained on, a seeded sample of unmeasured shapes the
fallback decides (odd N, N not a multiple of 8, small and huge K), every M in M_SET and both modes.

Launches run on a `Runner`: `GpuRunner` (CuPy, random weights per shape, comparisons on the device, one host
transfer per shape) or `EmulatorRunner` (kernels.emulate on a CPU, recorded as emulator-level). A certificate
is canonical JSON binding the digests of the rendered module, kernel sources, corpus, shape inventories and
policy, the device, the M set, the modes, the tool version, and each check's result, level, seed and counts.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from ...kernels import digests, emulate
from ...kernels.codebooks import formats_of, get
from ...kernels.errors import BLOCK, EnvironmentProblem, InputError
from ...kernels.layout import PackedWeights, random_planes
from ...kernels.registry import Candidate, by_id
from .. import __version__
from ..common.contract import MODES
from ..common.contract import SERVED_MS as M_SET
from ..common.digests import sha256, with_digest
from ..common.gpu import Gpu, gpu_slug
from ..learn.policy import Policy
from ..measure.timing import cell_seed
from .bundle import CERT_FORMAT

ROWS = max(M_SET)  # activation rows per K; every launch reads a subset of them
POISON = 0x7FBADBAD  # a NaN pattern no kernel writes (GPU NaNs are the canonical 0x7FFFFFFF)
EMULATED_COLUMNS = 16  # output columns the emulator computes per shape (see EmulatorRunner)
SAMPLED_PER_CODEBOOK = 6  # unmeasured shapes per codebook decided by the fallback
MAX_SAMPLED_WEIGHTS = 1 << 26  # N·K bound of a sampled shape: keeps GPU memory and time lean
MAX_FAILURES_KEPT = 20  # per check, in the certificate; the total count is always kept
Level = Literal["gpu", "emulator"]
Result = Literal["pass", "fail", "skipped"]


class Select(Protocol):
    """A dispatch decision (policy.Policy.select, a generated module's or an installed table's select)."""

    def __call__(self, codebook: str, m: int, n: int, k: int, mode: str) -> Any:
        """An object with `.candidate` (id) and `.identity` (int)."""
        ...


def inventories_digest(folder: Any = None) -> str:
    """SHA-256 over the shape inventory files (sorted name, then each file's SHA-256)."""
    from ..common.paths import shapes_dir

    files = sorted((folder or shapes_dir()).glob("*.json"))
    if not files:
        raise InputError(f"{folder or shapes_dir()}: no shape inventories (*.json)")
    return sha256("".join(f"{p.name}\0{sha256(p.read_bytes())}\n" for p in files).encode())


# ---------------------------------------------------------------------------------------------------------
# Keys


@dataclass(frozen=True, order=True)
class Shape:
    codebook: str  # execution key, e.g. "q4_0"
    n: int
    k: int
    origin: str  # "measured" (in the corpus) or "sampled" (unmeasured, decided by the fallback)

    def __str__(self) -> str:
        return f"{self.codebook} N={self.n} K={self.k}"


@dataclass(frozen=True, order=True)
class Key:
    shape: Shape
    m: int
    mode: str

    def __str__(self) -> str:
        return f"{self.shape} M={self.m} {self.mode}"


def measured_shapes(policy: Policy) -> list[Shape]:
    """Every (codebook, N, K) the table knows: trained on (measured) or carrying an overlay."""
    return [Shape(cb, n, k, "measured") for cb, n, k in policy.table_shapes()]


# Each kind draws N and K = unit * r, where unit is the format's weights per GGUF block (32, or 256 for the
# super-block formats) and r is drawn from a range scaled by BLOCK / unit, so K spans the same range either way.
def _k(rng: np.random.Generator, unit: int, lo: int, hi: int) -> int:
    return unit * int(rng.integers(max(1, lo * BLOCK // unit), max(2, hi * BLOCK // unit)))


def _odd_n(rng: np.random.Generator, unit: int) -> tuple[int, int]:
    return 2 * int(rng.integers(0, 8192)) + 1, _k(rng, unit, 1, 512)


def _n_4_mod_8(rng: np.random.Generator, unit: int) -> tuple[int, int]:
    return 8 * int(rng.integers(0, 4096)) + 4, _k(rng, unit, 1, 512)


def _small_k(rng: np.random.Generator, unit: int) -> tuple[int, int]:
    return int(rng.integers(1, 1 << 17)), _k(rng, unit, 1, 3)


def _huge_k(rng: np.random.Generator, unit: int) -> tuple[int, int]:
    return int(rng.integers(1, 256)), _k(rng, unit, 2048, 4097)


def _single_row(rng: np.random.Generator, unit: int) -> tuple[int, int]:
    return 1, _k(rng, unit, 1, 2048)


def _any_shape(rng: np.random.Generator, unit: int) -> tuple[int, int]:
    return int(rng.integers(1, 1 << 15)), _k(rng, unit, 1, 1024)


SAMPLE_KINDS = (_odd_n, _n_4_mod_8, _small_k, _huge_k, _single_row, _any_shape)


def sampled_shapes(codebooks: Iterable[str], measured: Iterable[Shape], seed: int,
                   per_codebook: int = SAMPLED_PER_CODEBOOK) -> list[Shape]:
    """A seeded sample of shapes the table was not trained on, so the fallback decides them: per codebook, one
    of each SAMPLE_KINDS in turn (odd N, N = 4 mod 8, the smallest K, a huge K (2^16..2^17) with a small N,
    N = 1, anything), K a whole number of the format's blocks. N·K stays <= MAX_SAMPLED_WEIGHTS so a sampled
    shape costs the GPU little."""
    known = {(s.codebook, s.n, s.k) for s in measured}
    out: set[Shape] = set()
    for cb in sorted(set(codebooks)):
        rng = np.random.default_rng(cell_seed("sampled-shapes", cb, seed))
        unit = get(cb).weights
        picked = 0
        for attempt in range(100 * per_codebook):
            n, k = SAMPLE_KINDS[attempt % len(SAMPLE_KINDS)](rng, unit)
            shape = Shape(cb, n, k, "sampled")
            if n * k > MAX_SAMPLED_WEIGHTS or (cb, n, k) in known or shape in out:
                continue
            out.add(shape)
            picked += 1
            if picked == per_codebook:
                break
    return sorted(out)


def activations(k: int, seed: int) -> np.ndarray:
    """float32 [ROWS, K], seeded per K, with the awkward blocks the contract must survive: an all-zero block,
    a subnormal block, a block of −0 and +values, a block near the fp32 maximum and an outlier."""
    rng = np.random.default_rng(cell_seed("activations", k, seed))
    x = rng.standard_normal((ROWS, k), dtype=np.float32)
    blocks = x.reshape(ROWS, k // BLOCK, BLOCK)
    some = np.array([r for r in range(ROWS) if r % 3])  # not every row: rows must differ for the permutation
    kb = k // BLOCK
    if kb > 0:
        blocks[some, 0] = 0.0
    if kb > 1:
        blocks[some, 1] *= np.float32(1e-40)
    if kb > 2:
        blocks[some, 2, ::2] = -0.0
    if kb > 3:
        blocks[some, 3] *= np.float32(1e37)
    if kb > 4:
        blocks[some, 4, 7] = np.float32(3e4)
    return x


def permutation(m: int, seed: int) -> tuple[int, ...]:
    """A seeded permutation of rows 0..m-1 that moves at least one row when m > 1."""
    rng = np.random.default_rng(cell_seed("permutation", m, seed))
    perm = tuple(int(i) for i in rng.permutation(m))
    return perm if m == 1 or perm != tuple(range(m)) else perm[1:] + perm[:1]


# ---------------------------------------------------------------------------------------------------------
# Runners


class Runner(Protocol):
    """Where launches run. `launch` returns float32 [len(rows), C] in `xp` (numpy or cupy): output columns
    `columns()` of y = W·x[rows] computed by `candidate`, in an output buffer that was poisoned first."""

    level: Level
    xp: Any

    def __enter__(self) -> Runner:
        """Runs are made inside `with runner:` (the GPU runner makes its stream current)."""
        ...

    def __exit__(self, *exc: object) -> None: ...

    def device(self) -> dict[str, str]:
        """{"name", "uuid"} of what ran the launches ("emulator" for the CPU stand-in)."""
        ...

    def load(self, fmt: str, n: int, k: int, seed: int) -> None:
        """Make random weights of source format `fmt` and shape (N, K) current (and activations for K)."""
        ...

    def columns(self) -> np.ndarray | None:
        """Output columns a launch returns (None: all N)."""
        ...

    def launch(self, candidate: Candidate, rows: tuple[int, ...]) -> Any: ...

    def emulate(self, candidate: Candidate, rows: tuple[int, ...]) -> tuple[Any, np.ndarray] | None:
        """(device bytes, emulator bytes) of the same sampled columns for one launch; None where the runner is
        the emulator itself."""
        ...

    def to_host(self, a: Any) -> np.ndarray: ...


def _sample_columns(n: int, seed: int, count: int = EMULATED_COLUMNS) -> np.ndarray:
    """Sorted output columns: the first and last (edge tiles) and seeded others."""
    if n <= count:
        return np.arange(n)
    rng = np.random.default_rng(cell_seed("columns", n, seed))
    rest = rng.choice(np.arange(1, n - 1), size=count - 2, replace=False)
    return np.sort(np.concatenate([[0, n - 1], rest]))


def _random_planes(fmt: str, n: int, k: int, rng: np.random.Generator) -> PackedWeights:
    """Host planes of layout.random_planes, as kernels.launch.random_weights makes them on the device."""
    book = get(fmt)
    p = random_planes(fmt, n, k, rng)
    return PackedWeights(book.name, book.execution, n, k, p["payload"], p["scale"], p.get("min"), p.get("high"),
                         p.get("sub"))


class EmulatorRunner:
    """kernels.emulate standing in for a GPU (CI, replay): emulator-level certification.

    For speed it computes EMULATED_COLUMNS seeded output columns per shape, and each identity once per shape over
    all ROWS activation rows; a launch is served as those rows of its identity's result. Both rest on the
    contract (§1): an output element depends only on its x row, its W row and the identity. What it still
    proves is what the table decides: every key's candidate is valid, and every M and mode of a shape gets the
    identity of its M=1 launches (else grouped != serial on random data)."""

    level: Level = "emulator"
    xp = np

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._packed: PackedWeights | None = None
        self._cols = np.arange(0)
        self._n = 0
        self._by_identity: dict[int, np.ndarray] = {}
        self._x: tuple[int, np.ndarray] | None = None

    def __enter__(self) -> EmulatorRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def device(self) -> dict[str, str]:
        return {"name": "emulator", "uuid": "emulator"}

    def load(self, fmt: str, n: int, k: int, seed: int) -> None:
        self._cols = _sample_columns(n, seed)
        self._n = n
        rng = np.random.default_rng(seed)
        self._packed = _random_planes(fmt, len(self._cols), k, rng)
        self._by_identity = {}
        if self._x is None or self._x[0] != k:
            self._x = (k, activations(k, self._seed))

    def columns(self) -> np.ndarray:
        return self._cols

    def launch(self, candidate: Candidate, rows: tuple[int, ...]) -> np.ndarray:
        assert self._packed is not None and self._x is not None, "load() a shape first"
        k = self._packed.k
        reason = candidate.invalid_reason(len(rows), self._n, k)
        if reason:
            raise InputError(f"candidate {candidate.id} cannot run M={len(rows)}, N={self._n}, K={k}: {reason}")
        ident = candidate.identity(k)
        if ident not in self._by_identity:
            qa = emulate.quantize_activations(self._x[1], k)
            self._by_identity[ident] = emulate.gemv_quantized(self._packed, qa, candidate.ksplit)
        return self._by_identity[ident][list(rows)]

    def emulate(self, candidate: Candidate, rows: tuple[int, ...]) -> None:
        return None

    def to_host(self, a: np.ndarray) -> np.ndarray:
        return a


class GpuRunner:
    """CuPy on CUDA device 0, every launch on one non-blocking stream (entered as the current stream for the
    whole run, so comparisons order after the launches they read). Weights are random device planes made once
    per shape; activations are quantized once per (K, rows) and reused by every shape of that K."""

    level: Level = "gpu"

    def __init__(self, seed: int = 0, gpu: Gpu | None = None) -> None:
        from ...kernels import launch

        self._launch = launch
        gpu = gpu or Gpu.open()
        self.xp = gpu.cp
        self._device = gpu.identity()
        self.arch = gpu.arch
        self.stream = gpu.stream
        self._seed = seed
        self._weights: Any = None
        self._packed_cols: PackedWeights | None = None
        self._cols = np.arange(0)
        self._x: tuple[int, np.ndarray, Any] | None = None
        self._qact: dict[tuple[int, ...], Any] = {}

    def __enter__(self) -> GpuRunner:
        self.stream.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.synchronize()
        self.stream.__exit__(*exc)

    def device(self) -> dict[str, str]:
        return dict(self._device)

    def load(self, fmt: str, n: int, k: int, seed: int) -> None:
        cp = self.xp
        self._weights = None
        cp.get_default_memory_pool().free_all_blocks()  # the last shape's buffers, before the next weights
        with self.stream:
            self._weights = self._launch.random_weights(fmt, n, k, cp.random.default_rng(seed))
        self._cols = _sample_columns(n, seed)
        self._packed_cols = None
        if self._x is None or self._x[0] != k:
            host = activations(k, self._seed)
            with self.stream:
                self._x = (k, host, cp.asarray(host))
            self._qact = {}

    def columns(self) -> None:
        return None

    def _activations(self, rows: tuple[int, ...]) -> Any:
        if rows not in self._qact:
            assert self._x is not None
            with self.stream:
                x = self.xp.ascontiguousarray(self._x[2][list(rows)])
            self._qact[rows] = self._launch.quantize_activations(x, self.stream)
        return self._qact[rows]

    def launch(self, candidate: Candidate, rows: tuple[int, ...]) -> Any:
        cp, w = self.xp, self._weights
        m = len(rows)
        need = candidate.workspace_bytes(m, w.n, w.k)
        with self.stream:
            out = cp.full((m, w.n), POISON, dtype=cp.uint32).view(cp.float32)
            workspace = self._launch.new_workspace(need, w.n) if need else None
        self._launch.gemv(candidate, w, self._activations(rows), out, self.stream, workspace=workspace)
        return out

    def emulate(self, candidate: Candidate, rows: tuple[int, ...]) -> tuple[Any, np.ndarray]:
        if self._packed_cols is None:
            w, cols = self._weights, self._cols

            def host(plane: Any, view: Any = None) -> np.ndarray | None:
                if plane is None:
                    return None
                part = self.xp.asnumpy(plane[:, cols], stream=self.stream)
                return part.view(view) if view is not None else part

            book = get(w.codebook)
            self._packed_cols = PackedWeights(book.name, book.execution, len(cols), w.k, host(w.payload),
                                              host(w.scale, np.float16), host(w.min, np.float16), host(w.high),
                                              host(w.sub))
        assert self._x is not None
        qa = emulate.quantize_activations(np.ascontiguousarray(self._x[1][list(rows)]), self._x[0])
        want = emulate.gemv_quantized(self._packed_cols, qa, candidate.ksplit)
        got = self.launch(candidate, rows)[:, self.xp.asarray(self._cols)]
        return got, want

    def to_host(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a, stream=self.stream)


DEVICES = ("auto", "gpu", "emulator")


def runner_for(device: str, seed: int = 0, gpu: Gpu | None = None) -> Runner:
    """The runner a --device option names: "gpu" (InputError without one), "emulator", or "auto" (the GPU
    where CuPy sees one, else the emulator)."""
    if device not in DEVICES:
        raise InputError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "emulator":
        return EmulatorRunner(seed)
    try:
        return GpuRunner(seed, gpu)
    except (InputError, EnvironmentProblem):
        if device == "gpu":
            raise
        return EmulatorRunner(seed)


# ---------------------------------------------------------------------------------------------------------
# Checks


def differs(xp: Any, got: Any, want: Any) -> Any:
    """Whether two float32 arrays differ in any bit (+0/−0 distinct): a 0-d bool in `xp`, not synced."""
    if got.shape != want.shape:
        return xp.asarray(True)
    return (got.view(xp.uint32) != xp.asarray(want).view(xp.uint32)).any()  # the emulator's `want` is numpy


def first_difference(got: np.ndarray, want: np.ndarray, columns: np.ndarray | None) -> str:
    """'row r, column c: got 0x..., want 0x...' for the first differing element (columns map to output N)."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    g, w = got.view(np.uint32), want.view(np.uint32)
    r, c = (int(i) for i in np.argwhere(g != w)[0])
    col = int(columns[c]) if columns is not None else c
    return (f"row {r}, column {col}: got {g[r, c]:#010x} ({got[r, c]!r}), want {w[r, c]:#010x} ({want[r, c]!r}); "
            f"{int((g != w).sum())} of {g.size} elements differ")


@dataclass
class Tally:
    """What one check did: counts, and its failures (the first MAX_FAILURES_KEPT described)."""

    keys: int = 0
    comparisons: int = 0
    elements: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.failed += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append(message)


class ShapeRun:
    """One shape (in one source format) on a runner: memoized dispatch choices and launches, and the
    comparisons the checks queue, settled with one host transfer (`settle`)."""

    def __init__(self, runner: Runner, select: Select, shape: Shape, fmt: str, seed: int,
                 tallies: dict[str, Tally], emulator_keys: frozenset[Key] = frozenset()) -> None:
        self.runner, self.select, self.shape, self.fmt, self.seed = runner, select, shape, fmt, seed
        self.tallies, self.emulator_keys = tallies, emulator_keys
        runner.load(fmt, shape.n, shape.k, cell_seed("weights", fmt, shape.n, shape.k, seed))
        self._choices: dict[tuple[int, str], Candidate | str] = {}
        self._launched: dict[tuple[str, tuple[int, ...], int], Any] = {}
        self._pending: list[tuple[str, str, Any, Any, Any]] = []  # check, what, flag, got, want
        self.launches = 0

    def all_keys(self) -> Iterator[Key]:
        return (Key(self.shape, m, mode) for m in M_SET for mode in MODES)

    def choice(self, key: Key) -> Candidate | str:
        """The dispatched candidate for a key, or why there is none (a string)."""
        slot = (key.m, key.mode)
        if slot not in self._choices:
            s = self.shape
            try:
                made = self.select(s.codebook, key.m, s.n, s.k, key.mode)
                cand = by_id(made.candidate)
                reason = cand.invalid_reason(key.m, s.n, s.k)
                if reason:
                    raise InputError(f"{cand.id} is not valid: {reason}")
                if made.identity != cand.identity(s.k):
                    raise InputError(f"{cand.id} has identity {cand.identity(s.k)}, select says {made.identity}")
                self._choices[slot] = cand
            except (InputError, ValueError, KeyError, AttributeError) as err:
                self._choices[slot] = f"select failed: {err}"
        return self._choices[slot]

    def launch(self, check: str, key: Key, rows: tuple[int, ...], repeat: int = 0) -> Any | None:
        """The key's dispatched launch over activation rows `rows` (memoized per candidate, rows and repeat);
        None (the failure recorded under `check`) where there is no valid choice or the launch is refused."""
        cand = self.choice(key)
        if isinstance(cand, str):
            return None
        memo = (cand.id, rows, repeat)
        if memo not in self._launched:
            try:
                self._launched[memo] = self.runner.launch(cand, rows)
                self.launches += 1
            except InputError as err:
                self.tallies[check].fail(f"{key} {cand.id}: launch refused: {err}")
                self._launched[memo] = None
        return self._launched[memo]

    def serial(self, check: str, key: Key, rows: int) -> Any | None:
        """M=1 dispatched launches of rows 0..rows-1 of `key`'s shape and mode, stacked."""
        one = Key(self.shape, 1, key.mode)
        parts = [self.launch(check, one, (r,)) for r in range(rows)]
        return None if any(p is None for p in parts) else self.runner.xp.concatenate(parts)

    def all_launched(self) -> list[tuple[str, Any]]:
        return [(f"{cid} rows {rows[:3]}..{len(rows)}", a) for (cid, rows, _), a in self._launched.items()
                if a is not None]

    def expect_same(self, check: str, key: Key, got: Any, want: Any) -> None:
        tally = self.tallies[check]
        tally.comparisons += 1
        tally.elements += int(np.prod(want.shape))
        self._pending.append((check, f"{key} {self._name(key)}", differs(self.runner.xp, got, want), got, want))

    def expect_differ(self, check: str, what: str, got: Any, want: Any) -> None:
        """A comparison that must find a difference (negative control): a failure when the bytes are equal."""
        self.tallies[check].comparisons += 1
        self._pending.append((check, what, ~differs(self.runner.xp, got, want), got, want))

    def expect_written(self, check: str, what: str, got: Any) -> None:
        tally = self.tallies[check]
        tally.comparisons += 1
        tally.elements += int(np.prod(got.shape))
        self._pending.append((check, what, (got.view(self.runner.xp.uint32) == POISON).any(), got, None))

    def _name(self, key: Key) -> str:
        cand = self.choice(key)
        return cand if isinstance(cand, str) else cand.id

    def settle(self) -> None:
        """Evaluate every queued comparison with one device-to-host transfer; describe the failures."""
        if not self._pending:
            return
        xp = self.runner.xp
        flags = self.runner.to_host(xp.stack([xp.asarray(p[2]).reshape(()) for p in self._pending]))
        columns = self.runner.columns()
        for (check, what, _, got, want), bad in zip(self._pending, flags, strict=True):
            if not bad:
                continue
            g = self.runner.to_host(got)
            if want is None:
                r, c = (int(i) for i in np.argwhere(g.view(np.uint32) == POISON)[0])
                col = int(columns[c]) if columns is not None else c
                self.tallies[check].fail(f"{what}: row {r}, column {col} was never written")
            elif check == "negative_control":
                self.tallies[check].fail(f"{what}: equal bytes; the comparison cannot detect a difference")
            else:
                detail = first_difference(g, self.runner.to_host(want), columns)
                self.tallies[check].fail(f"{what}: {detail}")
        self._pending = []


def check_seed(name: str, seed: int) -> int:
    """The seed a check records and uses, derived from the run's seed and the check's name."""
    return cell_seed("check", name, seed)


def check_selection(run: ShapeRun) -> None:
    """Every key gets a valid candidate whose identity is that of the shape's M=1 graph launch."""
    tally = run.tallies["selection"]
    base = run.choice(Key(run.shape, 1, "graph"))
    for key in run.all_keys():
        tally.keys += 1
        tally.comparisons += 1
        cand = run.choice(key)
        if isinstance(cand, str):
            tally.fail(f"{key}: {cand}")
        elif isinstance(base, Candidate) and cand.identity(key.shape.k) != base.identity(key.shape.k):
            tally.fail(f"{key}: {cand.id} has identity {cand.identity(key.shape.k)}, M=1 graph has "
                       f"{base.identity(key.shape.k)} ({base.id})")


def check_grouped_equals_serial(run: ShapeRun) -> None:
    """The grouped launch of M rows == M serial M=1 launches of the same rows, byte for byte."""
    for key in run.all_keys():
        run.tallies["grouped_equals_serial"].keys += 1
        grouped = run.launch("grouped_equals_serial", key, tuple(range(key.m)))
        serial = run.serial("grouped_equals_serial", key, key.m)
        if grouped is not None and serial is not None:
            run.expect_same("grouped_equals_serial", key, grouped, serial)


def check_repeat_identical(run: ShapeRun) -> None:
    """A second launch of the same key and rows gives the same bytes."""
    for key in run.all_keys():
        run.tallies["repeat_identical"].keys += 1
        rows = tuple(range(key.m))
        first = run.launch("repeat_identical", key, rows)
        again = run.launch("repeat_identical", key, rows, repeat=1)
        if first is not None and again is not None:
            run.expect_same("repeat_identical", key, again, first)


def check_permutation(run: ShapeRun) -> None:
    """Permuting the activation rows permutes the output rows exactly."""
    seed = check_seed("permutation", run.seed)
    for key in run.all_keys():
        run.tallies["permutation"].keys += 1
        perm = permutation(key.m, seed)
        straight = run.launch("permutation", key, tuple(range(key.m)))
        permuted = run.launch("permutation", key, perm)
        if straight is not None and permuted is not None:
            run.expect_same("permutation", key, permuted, straight[run.runner.xp.asarray(perm)])


def check_poison(run: ShapeRun) -> None:
    """Every element of every launch's output was written (outputs start as the POISON pattern)."""
    for key in run.all_keys():
        run.tallies["poison"].keys += 1
        run.launch("poison", key, tuple(range(key.m)))
    for what, out in run.all_launched():
        run.expect_written("poison", f"{run.shape} {what}", out)


def check_emulator_equality(run: ShapeRun) -> None:
    """Device bytes == the CPU emulator's on the keys sampled for this shape (EMULATED_COLUMNS columns)."""
    for key in sorted(k for k in run.emulator_keys if k.shape == run.shape):
        cand = run.choice(key)
        if isinstance(cand, str):
            continue
        run.tallies["emulator_equality"].keys += 1
        try:
            pair = run.runner.emulate(cand, tuple(range(key.m)))
        except InputError as err:
            run.tallies["emulator_equality"].fail(f"{key} {cand.id}: launch refused: {err}")
            continue
        if pair is not None:
            run.expect_same("emulator_equality", key, *pair)


SHAPE_CHECKS: dict[str, Callable[[ShapeRun], None]] = {
    "selection": check_selection,
    "grouped_equals_serial": check_grouped_equals_serial,
    "repeat_identical": check_repeat_identical,
    "permutation": check_permutation,
    "emulator_equality": check_emulator_equality,
    "poison": check_poison,  # last: it also inspects every launch the other checks made
}
NEGATIVE_SHAPE = Shape("q4_0", 1000, 4096, "control")
NEGATIVE_PAIR = ("wide.s1.t128.c1", "kpar.s8.t128.c1")  # identities 1 and 8 for K = 4096


def check_negative_control(runner: Runner, seed: int, tallies: dict[str, Tally]) -> None:
    """Two candidates of different identities on random data must compare as different with the same
    comparison every other check uses: proof that those checks can fail."""
    run = ShapeRun(runner, _no_select, NEGATIVE_SHAPE, "Q4_0", seed, tallies)
    a, b = (by_id(c) for c in NEGATIVE_PAIR)
    assert a.identity(NEGATIVE_SHAPE.k) != b.identity(NEGATIVE_SHAPE.k)
    rows = tuple(range(4))
    tallies["negative_control"].keys += 1
    run.expect_differ("negative_control", f"{NEGATIVE_SHAPE} M=4 {a.id} vs {b.id}", runner.launch(a, rows),
                      runner.launch(b, rows))
    run.settle()


def _no_select(codebook: str, m: int, n: int, k: int, mode: str) -> Any:
    raise AssertionError("the negative control launches its candidates directly")


def emulator_sample(select: Select, shapes: Sequence[Shape], seed: int) -> frozenset[Key]:
    """One seeded key per (codebook, identity, engine) the table chooses among the keys: the emulator check's
    coverage. Keys whose selection fails are left to the selection check."""
    groups: dict[tuple[str, int, str], list[Key]] = {}
    for key, cand in _chosen(select, shapes):
        groups.setdefault((key.shape.codebook, cand.identity(key.shape.k), cand.engine), []).append(key)
    rng = np.random.default_rng(cell_seed("emulator-sample", seed))
    # Prefer the smaller shapes of a group: the emulator runs on the CPU.
    picked = set()
    for group in sorted(groups):
        keys = sorted(groups[group], key=lambda key: (key.shape.n * key.shape.k, key))
        picked.add(keys[int(rng.integers(0, max(1, len(keys) // 4)))])
    return frozenset(picked)


def kernel_instantiations(select: Select, shapes: Sequence[Shape]) -> list[str]:
    """The template instantiations the table launches over the keys (for the spill check)."""
    return sorted({cand.kernel_name(fmt, key.m) for key, cand in _chosen(select, shapes)
                   for fmt in formats_of(key.shape.codebook)})


def _chosen(select: Select, shapes: Sequence[Shape]) -> Iterator[tuple[Key, Candidate]]:
    """Every key of the shapes with the candidate the table selects; keys whose selection fails are left to
    the selection check."""
    for shape in shapes:
        for m in M_SET:
            for mode in MODES:
                try:
                    cand = by_id(select(shape.codebook, m, shape.n, shape.k, mode).candidate)
                except (InputError, ValueError, KeyError, AttributeError):
                    continue
                yield Key(shape, m, mode), cand


def check_spill_free(names: Sequence[str], arch: str, tally: Tally) -> str | None:
    """Compile the instantiations with nvcc -Xptxas -v: no spills and no stack frame. Returns why it was
    skipped (no nvcc), else None."""
    from ...kernels.ptxas import compile_parallel

    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    report = compile_parallel(list(names), arch)
    tally.keys = len(names)
    tally.comparisons = len(report)
    for r in report:
        if not r.spill_free:
            tally.fail(f"{r.describe()} ({arch})")
    return None


# ---------------------------------------------------------------------------------------------------------
# Running the checks


CHECKS: tuple[str, ...] = (*SHAPE_CHECKS, "negative_control", "spill_free")


@dataclass(frozen=True)
class Outcome:
    """One check's result as the certificate records it."""

    result: Result
    level: str  # "gpu" or "emulator" (the runner), "host" (selection), "nvcc:<arch>" (spill_free)
    seed: int
    counts: dict[str, int]
    failures: tuple[str, ...]
    reason: str | None = None  # why skipped

    def to_dict(self) -> dict[str, Any]:
        out = {"result": self.result, "level": self.level, "seed": self.seed, "counts": self.counts,
               "failures": list(self.failures)}
        return out | ({"reason": self.reason} if self.reason else {})


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_checks(runner: Runner, select: Select, shapes: Sequence[Shape], seed: int = 0,
               checks: Iterable[str] = CHECKS, arch: str = "sm_90",
               log: Callable[[str], None] = _log) -> dict[str, Outcome]:
    """Run the named checks over `shapes` x M_SET x MODES with dispatch by `select` on `runner`.

    Each check's seed is derived from `seed` and its name; a check not asked for is absent from the result."""
    wanted = list(dict.fromkeys(checks))
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        raise InputError(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    tallies = {name: Tally() for name in CHECKS}
    seeds = {name: check_seed(name, seed) for name in CHECKS}
    reasons: dict[str, str] = {}
    shape_checks = [SHAPE_CHECKS[name] for name in SHAPE_CHECKS if name in wanted]
    start = time.monotonic()
    if "emulator_equality" in wanted and runner.level == "emulator":
        reasons["emulator_equality"] = "the emulator runs the launches itself: nothing to compare it against"
        shape_checks.remove(check_emulator_equality)
    sample = emulator_sample(select, shapes, seed) if check_emulator_equality in shape_checks else frozenset()
    launches, last = 0, time.monotonic()
    if shape_checks:
        for i, shape in enumerate(shapes, start=1):
            for fmt in formats_of(shape.codebook):
                run = ShapeRun(runner, select, shape, fmt, seed, tallies, sample)
                for check in shape_checks:
                    check(run)
                run.settle()
                launches += run.launches
            if time.monotonic() - last > 15 or i == len(shapes):
                last = time.monotonic()
                log(f"  {i}/{len(shapes)} shapes, {launches} launches, {last - start:.1f} s")
    if "negative_control" in wanted:
        check_negative_control(runner, seeds["negative_control"], tallies)
    if "spill_free" in wanted:
        reason = check_spill_free(kernel_instantiations(select, shapes), arch, tallies["spill_free"])
        if reason:
            reasons["spill_free"] = reason
    levels = {name: runner.level for name in CHECKS} | {"selection": "host", "spill_free": f"nvcc:{arch}"}
    outcomes = {}
    for name in wanted:
        t = tallies[name]
        result: Result = "skipped" if name in reasons else "fail" if t.failed else "pass"
        counts = {"keys": t.keys, "comparisons": t.comparisons, "elements": t.elements, "failed": t.failed}
        outcomes[name] = Outcome(result, levels[name], seeds[name], counts, tuple(t.failures), reasons.get(name))
        log(f"  {name}: {result}" + (f" ({reasons[name]})" if name in reasons else
                                     f", {t.comparisons} comparisons" + (f", {t.failed} failed" if t.failed else "")))
    return outcomes


# ---------------------------------------------------------------------------------------------------------
# Certificates


def corpus_digest(folder: Path) -> str:
    """SHA-256 of a corpus folder's manifest.json: what a policy records as its corpus."""
    try:
        return sha256((Path(folder) / "manifest.json").read_bytes())
    except FileNotFoundError:
        raise InputError(f"{folder}: not a corpus folder (no manifest.json)") from None


def check_policy(policy: Policy, corpus_folder: Path | None = None) -> None:
    """InputError unless the policy was made for the code these kernels run (and, if given, this corpus)."""
    source = policy.source
    code = source.get("code_digest")
    if code != digests.code_digest():
        raise InputError(f"the policy was trained for kernel code {str(code)[:12]}, these kernels run "
                         f"{digests.code_digest()[:12]}: sweep (only what changed is re-timed) and train again")
    wanted = str(source.get("corpus_manifest_sha256"))
    if corpus_folder is not None and corpus_digest(corpus_folder) != wanted:
        raise InputError(f"the policy was trained on another corpus than {corpus_folder} (manifest SHA-256 "
                         f"{corpus_digest(corpus_folder)[:12]}, the policy's {wanted[:12]})")


def policy_digests(policy: Policy, inventories: str | None = None) -> dict[str, str]:
    """The module-independent digests a table carries (the generated module's DIGESTS, the certificate's without
    its artifacts): policy, corpus, kernel sources (provenance), the code the kernels run (what install checks),
    shape inventories (default: the shipped ones')."""
    return {"policy": policy.digest, "corpus": str(policy.source.get("corpus_manifest_sha256")),
            "kernels": str(policy.source.get("kernel_digest")), "code": str(policy.source.get("code_digest")),
            "inventories": inventories or inventories_digest()}


def certificate_fields(policy: Policy, artifacts: Mapping[str, bytes], level: str, device: Mapping[str, str],
                       seed: int, shapes: Sequence[Shape]) -> dict[str, Any]:
    """What every certificate states of its table: format, level, GPU model, device, digests (the artifacts'
    included), tool version, seed, M set, modes, shapes and key count; the checks are the caller's."""
    target = str(policy.source.get("gpu_name"))
    return {
        "format": CERT_FORMAT,
        "level": level,
        "gpu_name": target,
        "gpu_slug": gpu_slug(target),
        "device": dict(device),
        "digests": policy_digests(policy) | {"artifacts": {name: sha256(data) for name, data in artifacts.items()}},
        "tool_version": __version__,
        "seed": seed,
        "m_set": list(M_SET),
        "modes": list(MODES),
        "shapes": [[s.codebook, s.n, s.k, s.origin] for s in shapes],
        "keys": len(shapes) * len(M_SET) * len(MODES),
    }


def certify(policy: Policy, artifacts: Mapping[str, bytes], runner: Runner, *, seed: int = 0,
            corpus_folder: Path | None = None, checks: Iterable[str] = CHECKS, arch: str | None = None,
            log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Certify `policy` as rendered into `artifacts` ({file name: bytes}, e.g. the generated module and header,
    whose SHA-256s the certificate binds) on `runner`; return the certificate (with its own digest).

    The checks dispatch with `policy.select`: `generate` renders the same decisions (its tests prove it).
    InputError when the policy is for other kernel sources, another corpus (if `corpus_folder` is given) or,
    on a GPU runner, another GPU model."""
    check_policy(policy, corpus_folder)
    target = str(policy.source.get("gpu_name"))
    device = runner.device()
    if runner.level == "gpu" and device["name"] != target:
        raise InputError(f"this GPU is a {device['name']}; the policy is for {target}: certify it on that model")
    start = time.monotonic()
    measured = measured_shapes(policy)
    shapes = measured + sampled_shapes(policy.codebooks, measured, seed)
    keys = len(shapes) * len(M_SET) * len(MODES)
    log(f"certify: {len(measured)} table shapes + {len(shapes) - len(measured)} sampled, x {len(M_SET)} M x "
        f"{len(MODES)} modes = {keys} keys on {device['name']} ({runner.level}-level), seed {seed}")
    outcomes = run_checks(runner, policy.select, shapes, seed, checks,
                          arch or getattr(runner, "arch", "sm_90"), log)
    seconds = time.monotonic() - start
    passed = all(o.result != "fail" for o in outcomes.values()) and set(outcomes) == set(CHECKS)
    log(f"certify: {'passed' if passed else 'FAILED'} in {seconds:.1f} s")
    cert = certificate_fields(policy, artifacts, runner.level, device, seed, shapes) | {
        "passed": passed,
        "emulator": None if runner.level == "gpu" else {
            "columns_per_shape": EMULATED_COLUMNS,
            "note": "an output element depends only on its x row, its W row and the identity "
                    "(docs/contract.md §1): the emulator computes sampled columns, each identity once per shape "
                    "over all rows"},
        "checks": {name: o.to_dict() for name, o in outcomes.items()},
        "seconds": round(seconds, 1),
    }
    return with_digest(cert)


def certified_shapes(cert: Mapping[str, Any]) -> list[Shape]:
    """The shapes a certificate covered, to check them again."""
    return [Shape(cb, n, k, origin) for cb, n, k, origin in cert["shapes"]]
