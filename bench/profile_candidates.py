"""Look inside candidates with Nsight Compute: occupancy, issue activity, warp stall reasons.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        -k regex:gemv_ python bench/profile_candidates.py Q4_0:16:14336:4096:kpar.s8.t128.mma2 ...

Each argument is CODEBOOK:M:N:K:CANDIDATE; each candidate is launched three times on random weights (the
profiler's own cache control makes every launch cold). Diagnosis only: nothing here enters a corpus.
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


def parse_cell(text: str) -> tuple[str, int, int, int, str]:
    codebook, m, n, k, cid = text.split(":")
    return codebook, int(m), int(n), int(k), cid


if __name__ == "__main__":
    launch_cells([parse_cell(arg) for arg in sys.argv[1:]])
