"""Corpus speed on a synthetic corpus of the default plan (issue 8 targets), on the CPU.

    python bench/corpus_speed.py [--cells N]

Builds a corpus with a record for every candidate of every cell of the default sweep plan (1728 cells, about
47,000 records, under a fake provenance and the real kernel digest), then measures, best of three:
  load     load() and verify every record                              target <= 1 s for 50,000 records
  sweep    a replay sweep into an empty folder, per cell (staging one   target <= 5 ms per cell
           shard per cell), without and with the final compaction
  no-op    the same sweep again, everything already present            target <= 2 s
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gemv_dispatch.dispatch import __version__
from gemv_dispatch.dispatch.common.gpu import gpu_slug
from gemv_dispatch.dispatch.measure import corpus
from gemv_dispatch.dispatch.measure.corpus import Provenance, Record, timing_parameters
from gemv_dispatch.dispatch.measure.sweep import ReplayTimer, parse_plan, run_sweep, sweep_timing
from gemv_dispatch.dispatch.measure.timing import Stats
from gemv_dispatch.kernels import program
from gemv_dispatch.kernels.registry import candidates_for

PROVENANCE = Provenance(
    gpu_name="Bench GPU", gpu_uuid="GPU-00000000-0000-0000-0000-0000000000be", sm_count=132, l2_bytes=50 << 20,
    sm_clock_mhz=None, mem_clock_mhz=None, driver_version="0", cuda_runtime="13.0", cupy_version=None,
    kernel_digest=program.digest(), tool_version=__version__, timing=timing_parameters(sweep_timing()),
)


def build(root: Path, cells: int | None) -> Path:
    """The synthetic corpus: one compacted shard, deterministic made-up timings."""
    folder = root / gpu_slug(PROVENANCE.gpu_name)
    corpus.init(folder)
    records = []
    for cell in parse_plan(limit=cells).cells():
        for i, c in enumerate(candidates_for(cell.m, cell.n, cell.k)):
            median = 5.0 + cell.n * cell.k / 4e6 + i / 10
            stats = Stats(median, 0.98 * median, 1.05 * median, 0.01 * median, 15, 40, i % 3 == 0)
            records.append(Record.measured(cell, c, stats, 8, PROVENANCE.key))
    corpus.write_shard(folder, PROVENANCE, records)
    return folder


def best(fn: Callable[[], object], repeat: int = 3, setup: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, help="only the default plan's first N cells")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = build(Path(tmp) / "source", args.cells)
        loaded = corpus.load(source)
        n_records, n_cells = len(loaded.records), len(loaded.cells())
        plan = parse_plan(limit=args.cells)
        out = Path(tmp) / "out"

        def fresh() -> None:
            shutil.rmtree(out, ignore_errors=True)

        t_load = best(lambda: corpus.load(source))
        timer = ReplayTimer(loaded)
        t_stage = best(lambda: run_sweep(plan, out, timer, compact_at_end=False), setup=fresh)
        t_sweep = best(lambda: run_sweep(plan, out, timer), setup=fresh)
        t_noop = best(lambda: run_sweep(plan, out, timer))
        assert corpus.load(out / source.name).records == loaded.records, "the replay did not reproduce its source"

    rows = [
        ("load + verify", f"{n_records} records", f"{t_load:.2f} s", f"{t_load * 50_000 / n_records:.2f} s per 50k",
         "<= 1 s per 50k"),
        ("sweep, staging", f"{n_cells} cells", f"{t_stage:.2f} s", f"{t_stage / n_cells * 1e3:.2f} ms per cell",
         "<= 5 ms per cell"),
        ("sweep + compaction", f"{n_cells} cells", f"{t_sweep:.2f} s", f"{t_sweep / n_cells * 1e3:.2f} ms per cell",
         ""),
        ("no-op rerun", f"{n_cells} cells", f"{t_noop:.2f} s", "", "<= 2 s"),
    ]
    print("| step | size | time | rate | target |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
