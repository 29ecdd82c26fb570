"""Sweep (docs/architecture.md §4, §5): time every candidate over (codebook, M, N, K, mode) cells into the corpus.

Default plan (`parse_plan()` with no arguments): the union of the (N, K) geometries of every model inventory
in corpus/shapes/ (the synthetic grid is left out; pass it with --shapes), every codebook (a super-block one
where K is a multiple of 256), M in {1, 4, 16}, graph mode, `sweep_timing()` (cold L2, racing on, at most 15
rounds). Its cell count and wall time on an H200 are in docs/architecture.md.
Inventories from `shapes from-gguf` are typed: each of their shapes is swept in its own GGUF types (typed_cells).

Each finished cell becomes one staged shard (corpus.stage_shard: no manifest rewrite per cell), so an
interruption loses at most the cell in flight; a rerun adopts the staged shards and skips the cells the corpus
holds complete under the same provenance key (resume). A GPU is timed by one sweep at a time (gpulock). With
several devices, the parent splits the plan round robin by weight geometry, runs one child process per GPU,
and compacts at the end. A Ray cluster of many hosts and GPU models is swept by dispatch/measure/fleet.py (`--ray`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from ...kernels import program
from ...kernels.codebooks import CODEBOOKS, get
from ...kernels.errors import InputError
from ...kernels.registry import Candidate, candidates_for
from .. import __version__
from ..common.contract import MODES
from ..common.gpu import Gpu, gpu_slug, nvidia_smi
from . import corpus, gpulock
from .corpus import Cell, Corpus, Provenance, Record, timing_parameters
from .shapes import GRID_NAME, Inventory, default_inventory_dir, load_inventories
from .timing import (
    CupyBackend,
    Stats,
    TimingConfig,
    cell_seed,
    copies_for_cold_l2,
    time_candidates,
)

DEFAULT_CODEBOOKS = "all"
DEFAULT_MS = "1,4,16"
DEFAULT_MODES = "graph"


def sweep_timing(hot: bool = False) -> TimingConfig:
    """The sweep's timing parameters: the harness defaults with at most 15 rounds (racing ends most cells earlier),
    so the default plan stays within minutes on one GPU."""
    return TimingConfig(cold_l2=not hot, max_rounds=15)


@dataclass(frozen=True)
class SweepPlan:
    codebooks: tuple[str, ...]
    ms: tuple[int, ...]
    modes: tuple[str, ...]
    geometries: tuple[tuple[int, int], ...]  # (N, K)
    timing: TimingConfig = field(default_factory=TimingConfig)  # GpuTimer's; a replay reports its corpus's
    limit: int | None = None  # the first `limit` cells only (smoke runs)
    # (codebook, N, K) a typed inventory asks for (a GGUF model's shapes in their own types, typed_cells);
    # None: every codebook at every geometry.
    typed: frozenset[tuple[str, int, int]] | None = None

    def __post_init__(self) -> None:
        for cb in self.codebooks:
            if get(cb).name != cb:
                raise InputError(f"codebook {cb!r} is not spelled as the registry does ({get(cb).name!r})")
        bad = [m for m in self.ms if m < 1] or [mode for mode in self.modes if mode not in MODES]
        bad = bad or [(n, k) for n, k in self.geometries if n < 1 or k < 32 or k % 32]
        if bad or (self.limit is not None and self.limit < 1):
            raise InputError(f"sweep plan: invalid M, mode, (N, K) or limit: {bad or self.limit}")

    def cells(self) -> list[Cell]:
        """All cells, grouped by weight geometry (codebook, N, K) so a timer creates each weight set once. A
        codebook is left out where K is not a whole number of its GGUF blocks (a super-block format at K = 896)."""
        cells = [
            Cell(cb, m, n, k, mode)
            for cb in sorted(self.codebooks)
            for n, k in sorted(self.geometries)
            if k % get(cb).weights == 0 and (self.typed is None or (cb, n, k) in self.typed)
            for m in sorted(self.ms)
            for mode in MODES
            if mode in self.modes
        ]
        return cells[: self.limit]

    def part(self, index: int, count: int) -> list[Cell]:
        """Part `index` of `count`: whole geometries dealt round robin, so no two devices create one weight
        set and a resumed run deals every cell to the same part as before (the split ignores what is done)."""
        groups: dict[tuple[str, int, int], int] = {}
        return [c for c in self.cells() if groups.setdefault((c.codebook, c.n, c.k), len(groups)) % count == index]


def _items(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise InputError(f"{what}: expected a comma-separated list, got {text!r}")
    return items


def _positive_ints(text: str, what: str) -> list[int]:
    values = []
    for item in _items(text, what):
        if not item.isdigit() or int(item) < 1:
            raise InputError(f"{what}: {item!r} is not an integer >= 1")
        values.append(int(item))
    return values


def default_geometries() -> list[tuple[int, int]]:
    """The union of the model inventories' (N, K) in corpus/shapes/, without the synthetic grid."""
    inventories = load_inventories(default_inventory_dir())
    return sorted({g for inv in inventories if inv.name != GRID_NAME for g in inv.geometries()})


def parse_plan(codebooks: str = DEFAULT_CODEBOOKS, ms: str = DEFAULT_MS, modes: str = DEFAULT_MODES,
               shapes: Sequence[str | os.PathLike[str]] = (), limit: int | None = None,
               hot: bool = False) -> SweepPlan:
    """A plan from command-line text; every mistake raises one InputError naming it."""
    names = CODEBOOKS if codebooks.strip().lower() == "all" else [get(c).name for c in _items(codebooks, "--codebooks")]
    mode_list = _items(modes, "--modes")
    for mode in mode_list:
        if mode not in MODES:
            raise InputError(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
    if limit is not None and limit < 1:
        raise InputError(f"--limit must be >= 1, got {limit}")
    typed = None
    if shapes:
        inventories = load_inventories(shapes)
        geometries = sorted({g for inv in inventories for g in inv.geometries()})
        typed = typed_cells(inventories, names)
    else:
        geometries = default_geometries()
    return SweepPlan(tuple(dict.fromkeys(names)), tuple(sorted(set(_positive_ints(ms, "--m")))),
                     tuple(dict.fromkeys(mode_list)), tuple(geometries), sweep_timing(hot), limit, typed)


def typed_cells(inventories: Sequence[Inventory], codebooks: Sequence[str]) -> frozenset[tuple[str, int, int]] | None:
    """What typed inventories ask to sweep: each typed shape in its own GGUF types, an untyped shape in every
    codebook; all within `codebooks` (--codebooks). None when no shape is typed (the plan's full product);
    InputError when nothing is left."""
    shapes = [s for inv in inventories for s in inv.shapes]
    if not any(s.codebooks for s in shapes):
        return None
    wanted = {(cb, s.n, s.k) for s in shapes for cb in s.codebooks or codebooks if cb in codebooks}
    if not wanted:
        raise InputError(f"the inventories ask for no shape in the codebooks asked for ({', '.join(codebooks)})")
    return frozenset(wanted)


def parse_devices(text: str) -> list[str]:
    """CUDA device ids "0,1,..." (as CUDA_VISIBLE_DEVICES spells them), each at most once."""
    ids = []
    for item in _items(text, "--devices"):
        if not item.isdigit():
            raise InputError(f"--devices: {item!r} is not a device id (an integer >= 0)")
        ids.append(str(int(item)))
    if len(set(ids)) != len(ids):
        raise InputError(f"--devices: {text!r} names a device twice")
    return ids


# ---------------------------------------------------------------------------------------------------------
# Timers


@dataclass(frozen=True)
class CellTiming:
    stats: dict[str, Stats]  # candidate id -> stats
    copies: int  # weight copies rotated through (1 = hot L2)


class Timer(Protocol):
    """What a sweep times with: a GPU, or a corpus served back (replay)."""

    gpu_name: str  # the corpus folder is named after it
    kernel_digest: str  # the kernel sources it times (provenance: a folder may hold several)
    lock_key: str | None  # the GPU's UUID, locked while timing; None where no GPU is timed
    # What counts as already measured: a current record under any provenance of the GPU model and timing
    # parameters (a GPU: a kernel change or another GPU of the model re-times only what is missing), or under
    # exactly the provenance served (a replay, which reproduces every provenance of its source).
    model_level: bool

    def provenances(self, cell: Cell) -> tuple[Provenance, ...]:
        """The provenances this timer records `cell` under; empty when it cannot time it."""
        ...

    def measure(self, cell: Cell, provenance: Provenance, candidates: Sequence[Candidate]) -> CellTiming: ...


class ReplayTimer:
    """Serves the recorded stats of an existing corpus in place of a GPU, each cell under every provenance
    that holds all of its candidates, so replaying a corpus (of one or several GPUs of a model) into an
    empty folder reproduces it byte for byte and every later stage runs on a CPU. `delay_s` sleeps per
    cell, letting tests interrupt a sweep mid-way."""

    lock_key = None
    model_level = False

    def __init__(self, source: Corpus, delay_s: float = 0.0) -> None:
        if not source.provenances:
            raise InputError(f"{source.folder}: replay needs a corpus with records, this one is empty")
        first = next(iter(source.provenances.values()))
        self.gpu_name, self.kernel_digest = first.gpu_name, first.kernel_digest
        self._source, self._delay_s = source, delay_s

    def _served(self, cell: Cell) -> dict[str, dict[str, Record]]:
        """Provenance key -> candidate id -> record, for the provenances holding the whole cell."""
        by_key: dict[str, dict[str, Record]] = {}
        for r in self._source.records_for(cell):
            by_key.setdefault(r.provenance, {})[r.candidate] = r
        need = corpus.cell_candidates(cell.m, cell.n, cell.k)
        return {key: records for key, records in by_key.items() if records.keys() >= need.keys()}

    def provenances(self, cell: Cell) -> tuple[Provenance, ...]:
        return tuple(self._source.provenances[key] for key in sorted(self._served(cell)))

    def measure(self, cell: Cell, provenance: Provenance, candidates: Sequence[Candidate]) -> CellTiming:
        time.sleep(self._delay_s)
        records = self._served(cell).get(provenance.key, {})
        missing = [c.id for c in candidates if c.id not in records]
        if missing:
            raise InputError(f"{self._source.folder}: replay corpus has no record of cell {cell} for "
                             f"candidate {missing[0]} under provenance {provenance.key}")
        found = [records[c.id] for c in candidates]
        return CellTiming({r.candidate: r.stats for r in found}, found[0].copies)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def weight_copies(codebook: str, n: int, k: int, rng: Any, l2_bytes: int, cold: bool = True) -> list[Any]:
    """Random device weights (kernels.launch.random_weights) in enough copies that one rotation reads more
    than 3x L2; a single copy when `cold` is False. `rng` is a cupy.random.Generator."""
    from ...kernels import launch

    copies = [launch.random_weights(codebook, n, k, rng)]
    count = copies_for_cold_l2(copies[0].nbytes, l2_bytes) if cold else 1
    return copies + [launch.random_weights(codebook, n, k, rng) for _ in range(count - 1)]


class GpuTimer:
    """Times cells with CuPy on this process's CUDA device 0 (a --devices child sees only its own GPU).

    Weights are random planes in the execution layout (finite fp16 scales, random codes), created on the
    device once per (codebook, N, K) and reused for every M and mode: cells come grouped by geometry, so
    caching the last geometry suffices. Copies rotate past 3x the device's L2 unless the config is hot."""

    def __init__(self, config: TimingConfig, gpu: Gpu | None = None) -> None:
        from ...kernels import launch

        # Nsight Systems / Compute attach through this variable; nothing timed under them enters a corpus.
        if os.environ.get("CUDA_INJECTION64_PATH"):
            raise InputError("a CUDA profiler is attached (CUDA_INJECTION64_PATH is set); sweep without it")
        gpu = gpu or Gpu.open()
        self._cp = cp = gpu.cp
        self._launch, self.config = launch, config
        self._l2 = gpu.l2_bytes
        self.stream = gpu.stream
        self._backend = CupyBackend(self.stream)
        self._geometry: tuple[str, int, int] | None = None
        self._copies: list[Any] = []
        uuid = gpu.uuid
        # Application clocks: what the GPU runs at under load (current clocks read idle values here).
        smi = nvidia_smi(uuid, "driver_version,clocks.applications.graphics,clocks.applications.memory")
        self._provenance = Provenance(
            gpu_name=gpu.name,
            gpu_uuid=uuid,
            sm_count=gpu.sm_count,
            l2_bytes=self._l2,
            sm_clock_mhz=int(smi[1]) if smi and smi[1].isdigit() else None,
            mem_clock_mhz=int(smi[2]) if smi and smi[2].isdigit() else None,
            driver_version=smi[0] if smi else f"cuda-driver-api {_cuda_version(cp.cuda.runtime.driverGetVersion())}",
            cuda_runtime=_cuda_version(cp.cuda.runtime.runtimeGetVersion()),
            cupy_version=cp.__version__,
            kernel_digest=program.digest(),
            tool_version=__version__,
            timing=timing_parameters(config),
        )

        self.gpu_name, self.kernel_digest = self._provenance.gpu_name, self._provenance.kernel_digest
        self.model_level = True
        self.lock_key: str | None = uuid

    def provenance(self) -> Provenance:
        return self._provenance

    def provenances(self, cell: Cell) -> tuple[Provenance, ...]:
        return (self._provenance,)

    def measure(self, cell: Cell, provenance: Provenance, candidates: Sequence[Candidate]) -> CellTiming:
        if provenance != self._provenance:
            raise ValueError(f"this GPU records under provenance {self._provenance.key}, not {provenance.key}")
        return self.time_cell(cell.codebook, cell.m, cell.n, cell.k, cell.mode, candidates)

    def _weights(self, codebook: str, n: int, k: int) -> list[Any]:
        if self._geometry != (codebook, n, k):
            self._geometry, self._copies = None, []
            self._cp.get_default_memory_pool().free_all_blocks()  # the last geometry's copies, before new ones
            rng = self._cp.random.default_rng(cell_seed(codebook, n, k, self.config.seed))
            with self.stream:  # generated on the timing stream, so no launch can read them half-written
                copies = weight_copies(codebook, n, k, rng, self._l2, self.config.cold_l2)
            self.stream.synchronize()
            self._geometry, self._copies = (codebook, n, k), copies
        return self._copies

    def time_cell(self, codebook: str, m: int, n: int, k: int, mode: str,
                  candidates: Sequence[Candidate]) -> CellTiming:
        cp, launch = self._cp, self._launch
        copies = self._weights(codebook, n, k)
        seed = cell_seed(codebook, m, n, k, mode, self.config.seed)
        need = max(c.workspace_bytes(m, n, k) for c in candidates)
        with self.stream:
            # Standard normal activations: zeros would quantize to d_a = 0 and skip real work.
            x = cp.random.default_rng(seed).standard_normal((m, k), dtype=cp.float32)
            out = cp.empty((m, n), cp.float32)
            workspace = launch.new_workspace(need, n) if need else None
        qact = launch.quantize_activations(x, self.stream)
        launches = {c.id: launch.bind(c, copies, qact, out, self.stream, workspace) for c in candidates}
        stats = time_candidates(launches, len(copies),
                                replace(self.config, mode=mode), self._backend, seed=seed)
        return CellTiming(stats, len(copies))


# ---------------------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class SweepResult:
    folders: tuple[str, ...]
    provenances: tuple[str, ...]
    cells: int  # in this run's plan (or part of it)
    timed: int  # (cell, provenance) measurements made: one per cell, except replays of several GPUs
    skipped: int  # cells already in the corpus under every provenance
    records: int  # written by this run
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def merge(cls, parts: Iterable[SweepResult], seconds: float) -> SweepResult:
        parts = list(parts)
        return cls(tuple(sorted({f for p in parts for f in p.folders})),
                   tuple(sorted({k for p in parts for k in p.provenances})),
                   sum(p.cells for p in parts), sum(p.timed for p in parts), sum(p.skipped for p in parts),
                   sum(p.records for p in parts), seconds)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# A timed window lasts at least ~200 µs (TimingConfig.window_us), about what a GPU reads of 800 MB in:
# smaller weights still cost a window per candidate and round.
WINDOW_BYTES = 800e6
ETA_AFTER = 3  # cells measured before an ETA is shown: the first ones also pay compilation and warm-up


def cell_work(cell: Cell) -> float:
    """Relative cost of timing a cell, for the ETA: candidates x bytes read per launch window."""
    weight_bytes = cell.n * cell.k * get(cell.codebook).bits_per_weight / 8
    return len(corpus.cell_candidates(cell.m, cell.n, cell.k)) * max(weight_bytes, WINDOW_BYTES)


class Progress:
    """One status line with an ETA on stderr: redrawn in place on a terminal, else a line every `every_s`.

    The ETA extrapolates the time per unit of work of the cells measured so far (`works[i]` is cell i's
    work) to the work left; it is "?" until ETA_AFTER cells are measured."""

    def __init__(self, works: Sequence[float], label: str = "", stream: TextIO | None = None,
                 every_s: float = 30.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        # Children of a --devices run share one terminal: in-place redraws would overwrite each other.
        self.inplace = self.stream.isatty() and not label
        self.works, self.total, self.label, self.every_s = list(works), len(works), label, every_s
        self.start, self._last = time.monotonic(), -math.inf

    def eta(self, done: int, elapsed: float) -> str:
        measured = sum(self.works[:done])
        if done < ETA_AFTER or not measured:
            return "?"
        return _clock(elapsed / measured * sum(self.works[done:]))

    def update(self, done: int, note: str) -> None:
        now = time.monotonic()
        final = done == self.total
        if not final and now - self._last < (0.2 if self.inplace else self.every_s):
            return
        self._last = now
        elapsed = now - self.start
        line = (f"{self.label}{done}/{self.total} cells ({100 * done / self.total:.1f}%), {_clock(elapsed)} "
                f"elapsed, ETA {self.eta(done, elapsed)}: {note}")
        self.stream.write(f"\r\x1b[K{line}" + ("\n" if final else "") if self.inplace else line + "\n")
        self.stream.flush()


def cell_provenances(cells: Sequence[Cell], timer: Timer) -> dict[Cell, tuple[Provenance, ...]]:
    """Each cell's provenances; refuses, before anything is written, a plan with cells the timer cannot time
    (a replay source lacking them), naming the count and a few."""
    served = {cell: timer.provenances(cell) for cell in cells}
    lacking = [cell for cell, provenances in served.items() if not provenances]
    if lacking:
        examples = "; ".join(str(c) for c in lacking[:3])
        raise InputError(f"{len(lacking)} of {len(cells)} cells of the plan cannot be timed (a replay "
                         f"corpus lacks them or some of their candidates), e.g. {examples}")
    return served


def stage_cell(folder: Path, cell: Cell, provenance: Provenance, timing: CellTiming,
               candidates: Sequence[Candidate]) -> int:
    """Stage the records of the candidates timed in a cell as one shard; returns their count."""
    rows = [Record.measured(cell, c, timing.stats[c.id], timing.copies, provenance.key) for c in candidates]
    corpus.stage_shard(folder, provenance, rows)
    return len(rows)


def run_sweep(plan: SweepPlan, corpus_root: str | os.PathLike[str], timer: Timer, *,
              part: tuple[int, int] = (0, 1), compact_at_end: bool = True, label: str = "",
              wait: bool = False) -> SweepResult:
    """Time, in the plan's cells (part `part[0]` of `part[1]`), the candidates corpus_root/<gpu-slug>/ holds no
    current record of (`Corpus.missing`: after a kernel change, those whose code changed), one staged shard per
    (cell, provenance), then compact (a --devices parent compacts once, at the end; nothing to compact when
    nothing changed). The GPU's lock (`gpulock`) is held throughout; `wait` waits for another sweep of the
    GPU instead of refusing."""
    start = time.monotonic()
    cells = plan.part(*part)
    served = cell_provenances(cells, timer)
    keys = sorted({p.key for provenances in served.values() for p in provenances})
    folder = Path(corpus_root) / gpu_slug(timer.gpu_name)
    with gpulock.hold(timer.lock_key, wait=wait) if timer.lock_key else contextlib.nullcontext():
        existing, actions = corpus.resume(folder, gpu_name=timer.gpu_name)
        for action in actions:
            print(f"{label}{folder}: {action}", file=sys.stderr)
        todo = []
        for cell, provenances in served.items():
            for p in provenances:
                missing = set(existing.missing(cell, p, model=timer.model_level))
                if missing:
                    todo.append((cell, p, [c for c in candidates_for(cell.m, cell.n, cell.k) if c.id in missing]))
        progress = Progress([cell_work(cell) * len(c) / len(corpus.cell_candidates(cell.m, cell.n, cell.k))
                             for cell, _, c in todo], label)
        records = 0
        for i, (cell, provenance, candidates) in enumerate(todo, start=1):
            timing = timer.measure(cell, provenance, candidates)
            records += stage_cell(folder, cell, provenance, timing, candidates)
            progress.update(i, str(cell))
        if compact_at_end and (todo or len(existing.shards) != len(existing.provenances)):
            corpus.compact(folder)
    timed = {cell for cell, _, _ in todo}
    return SweepResult((str(folder),), tuple(keys), len(cells), len(todo), len(cells) - len(timed), records,
                       time.monotonic() - start)


def run_devices(devices: Sequence[str], argv: Sequence[str]) -> SweepResult:
    """One `python -m gemv_dispatch.dispatch.cli sweep ARGV --device-index i` child per device, each seeing
    only its GPU (CUDA_VISIBLE_DEVICES) and writing its own shards; then one deterministic compaction per folder."""
    start = time.monotonic()
    children = []
    for i, device in enumerate(devices):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
        cmd = [sys.executable, "-m", "gemv_dispatch.dispatch.cli", "sweep", *argv, "--json",
               "--device-index", str(i), "--device-count", str(len(devices))]
        children.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results, failed = [], []
    for device, child in zip(devices, children, strict=True):
        out, _ = child.communicate()
        if child.returncode:
            failed.append(f"device {device} (exit status {child.returncode})")
        else:
            results.append(SweepResult(**{k: tuple(v) if isinstance(v, list) else v
                                          for k, v in json.loads(out).items()}))
    if failed:
        raise RuntimeError(f"sweep failed on {', '.join(failed)}; rerun to resume")
    for folder in sorted({f for r in results for f in r.folders}):
        if (Path(folder) / corpus.MANIFEST).exists() or corpus.resume(folder)[0].shards:  # else nothing staged
            corpus.compact(Path(folder))
    return SweepResult.merge(results, time.monotonic() - start)
