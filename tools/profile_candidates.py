"""Look inside candidates with Nsight Compute: occupancy, issue activity, warp stall reasons.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        -k regex:gemv_ python tools/profile_candidates.py Q4_0:16:14336:4096:kpar.s8.t128.mma2 ...

Each argument is CODEBOOK:M:N:K:CANDIDATE, or stream:BYTES:GRID for bench/kernels.py's streaming read of that many
bytes on GRID CTAs (what a kernel that only reads the weights achieves; profile it with `-k regex:stream_read`);
each is launched three times on random data (the profiler's own cache control makes every launch cold). Diagnosis
only: nothing here enters a corpus.
`--clock-control none` keeps the GPU's own clocks; `python tools/ncu_summary.py LOG CELLS...` reduces the log to one
line per cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks: kernels.py, timing_vs_ncu.py
from timing_vs_ncu import launch_cells


def launch_stream_read(nbytes: int, grid: int, repeats: int = 3) -> None:
    """Launch bench/kernels.py's streaming read of `nbytes` on `grid` CTAs `repeats` times."""
    from kernels import stream_reads  # bench/kernels.py: imported only for a streaming cell

    stream = cp.cuda.Stream(non_blocking=True)
    read = stream_reads(nbytes, 1, stream)
    for _ in range(repeats):
        read(grid, 0)
    stream.synchronize()


def parse_cell(text: str) -> tuple[str, int, int, int, str]:
    codebook, m, n, k, cid = text.split(":")
    return codebook, int(m), int(n), int(k), cid


if __name__ == "__main__":
    for arg in sys.argv[1:]:  # in the order given: tools/ncu_summary.py reads the log's kernels in that order
        if arg.startswith("stream:"):
            _, nbytes, grid = arg.split(":")
            launch_stream_read(int(nbytes), int(grid))
        else:
            launch_cells([parse_cell(arg)])
