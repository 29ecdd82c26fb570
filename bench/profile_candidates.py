"""Look inside candidates with Nsight Compute: occupancy, issue activity, warp stall reasons.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        -k regex:gemv_ python bench/profile_candidates.py Q4_0:16:14336:4096:kpar.s8.t128.mma2 ...

Each argument is CODEBOOK:M:N:K:CANDIDATE; each candidate is launched three times on random weights (the
profiler's own cache control makes every launch cold). Diagnosis only: nothing here enters a corpus.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import launch
from kernels.registry import by_id


def main(cells: list[str]) -> None:
    stream = cp.cuda.Stream(non_blocking=True)
    for cell in cells:
        codebook, m, n, k, cid = cell.split(":")
        m, n, k = int(m), int(n), int(k)
        cand = by_id(cid)
        rng = cp.random.default_rng(n + k)
        with stream:
            weights = launch.random_weights(codebook, n, k, rng)
            x = rng.standard_normal((m, k), dtype=cp.float32)
            out = cp.empty((m, n), cp.float32)
            workspace = cp.empty(max(1, cand.workspace_bytes(m, n, k) // 4), cp.float32)
        qact = launch.quantize_activations(x, stream)
        for _ in range(3):
            launch.gemv(cand, weights, qact, out, stream, workspace)
        stream.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
