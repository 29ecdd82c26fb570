"""Look inside candidates with Nsight Compute: occupancy, issue activity, warp stall reasons.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        -k regex:gemv_ python bench/profile_candidates.py Q4_0:16:14336:4096:kpar.s8.t128.mma2 ...

Each argument is CODEBOOK:M:N:K:CANDIDATE, or stream:BYTES:GRID for bench/kernels.py's streaming read of that many
bytes on GRID CTAs (what a kernel that only reads the weights achieves; profile it with `-k regex:stream_read`);
each is launched three times on random data (the profiler's own cache control makes every launch cold). Diagnosis
only: nothing here enters a corpus.
`--clock-control none` keeps the GPU's own clocks; `python bench/ncu_summary.py LOG CELLS...` reduces the log to one
line per cell.
"""

from __future__ import annotations

import sys

import cupy as cp
from gemv_dispatch.kernels import launch
from gemv_dispatch.kernels.registry import by_id


def launch_cells(cells: list[tuple[str, int, int, int, str]], repeats: int = 3) -> None:
    """Launch each (codebook, M, N, K, candidate) `repeats` times on random weights, one stream."""
    stream = cp.cuda.Stream(non_blocking=True)
    for codebook, m, n, k, cid in cells:
        cand = by_id(cid)
        rng = cp.random.default_rng(n + k)
        with stream:
            weights = launch.random_weights(codebook, n, k, rng)
            x = rng.standard_normal((m, k), dtype=cp.float32)
            out = cp.empty((m, n), cp.float32)
            need = cand.workspace_bytes(m, n, k)
            workspace = launch.new_workspace(need, n) if need else None
        qact = launch.quantize_activations(x, stream)
        run = launch.bind(cand, [weights], qact, out, stream, workspace)
        for _ in range(repeats):
            run(0)
        stream.synchronize()


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
    for arg in sys.argv[1:]:  # in the order given: bench/ncu_summary.py reads the log's kernels in that order
        if arg.startswith("stream:"):
            _, nbytes, grid = arg.split(":")
            launch_stream_read(int(nbytes), int(grid))
        else:
            launch_cells([parse_cell(arg)])
