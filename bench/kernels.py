"""Kernel benchmark (issue: CUDA kernel families): best candidate per anchor shape vs the read ceiling,
torch's int4 tinygemm and cuBLAS fp16, all timed the same way in one run.

Every time is a CUDA-graph replay of R launches on one explicit stream, events recorded on that stream,
cold L2 by rotating weight copies past 3x the device's L2, interleaved rounds, medians
(dispatch.timing). Weights are random codes with finite random scales: no zeros, no special values.

    python bench/kernels.py --out bench/results/kernels-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
from gemv_dispatch.dispatch.sweep import GpuTimer, sweep_timing
from gemv_dispatch.dispatch.timing import CupyBackend, Launch, Rotation, Stats, copies_for_cold_l2, time_candidates
from gemv_dispatch.kernels.codebooks import CODEBOOKS, get
from gemv_dispatch.kernels.registry import by_id, candidates_for

ANCHORS = [(4096, 4096), (14336, 4096), (4096, 14336), (5120, 5120), (27648, 5120), (5120, 27648),
           (151936, 4096), (1024, 4096), (512, 2048)]
Q4_0_M = (1, 4, 8, 16)
CONFIG = replace(sweep_timing(), window_us=300.0)  # the sweep's settings, longer windows
STREAM_KERNEL = r"""
// Four independent 16-byte loads in flight per thread per step.
extern "C" __global__ void stream_read(const uint4* __restrict__ src, unsigned long long n16, unsigned* sink) {
    unsigned acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n16 ? __ldg(src + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the loads; practically never taken
}
"""


def time_ours(timer: GpuTimer, codebook: str, m: int, n: int, k: int) -> dict[str, Stats]:
    """Every candidate of the cell, timed as the sweep times it (racing drops the clearly beaten)."""
    return timer.time_cell(codebook, m, n, k, CONFIG.mode, candidates_for(m, n, k)).stats


def engine_bests(stats: dict[str, Stats]) -> dict[str, float]:
    """The fastest median per engine (dp4a, mma): what the tensor-core path adds at this cell."""
    best: dict[str, float] = {}
    for cid, st in stats.items():
        engine = by_id(cid).engine
        best[engine] = min(best.get(engine, math.inf), st.median_us)
    return best


class TorchBackend:
    """The same window protocol for torch baselines: torch.cuda.CUDAGraph of R launches, events on an
    explicit torch stream."""

    def __init__(self) -> None:
        import torch

        self.torch, self.stream = torch, torch.cuda.Stream()

    def prepare(self, fn: Launch, rotation: Rotation, mode: str) -> Any:
        torch, stream = self.torch, self.stream
        with torch.cuda.stream(stream):
            fn(rotation[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in rotation:
                fn(i)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        class Window:
            def run(self) -> float:
                with torch.cuda.stream(stream):
                    start.record(stream)
                    graph.replay()
                    stop.record(stream)
                stop.synchronize()
                return start.elapsed_time(stop)

            def close(self) -> None:
                pass

        return Window()


def time_baselines(m: int, n: int, k: int, l2: int, backend: TorchBackend) -> dict[str, float]:
    torch = backend.torch
    dev = "cuda"
    x16 = torch.randn(m, k, device=dev, dtype=torch.float16)
    xbf = x16.to(torch.bfloat16)
    fp16_bytes = n * k * 2
    fp16 = [torch.randn(n, k, device=dev, dtype=torch.float16) for _ in range(copies_for_cold_l2(fp16_bytes, l2))]
    int4_bytes = n * k // 2 + (k // 32) * n * 4
    int4 = []
    for _ in range(copies_for_cold_l2(int4_bytes, l2)):
        codes = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
        packed = torch._convert_weight_to_int4pack(codes, 8)
        sz = (torch.rand(k // 32, n, 2, device=dev) * 1e-2 + 1e-3).to(torch.bfloat16)
        int4.append((packed, sz))
    launches = {
        "cublas_fp16": lambda i: torch.matmul(x16, fp16[i].t()),
        "tinygemm_int4": lambda i: torch._weight_int4pack_mm(xbf, int4[i][0], 32, int4[i][1]),
    }
    out = {}
    for name, fn in launches.items():  # separate calls: the copy counts differ
        copies = len(fp16) if name == "cublas_fp16" else len(int4)
        out[name] = time_candidates({name: fn}, copies, CONFIG, backend)[name].median_us
    return out


def read_ceiling(l2: int, sms: int, stream: Any) -> float:
    """GB/s of a 16-byte-load streaming read over rotating 256 MiB buffers (> 3x L2 in rotation)."""
    kernel = cp.RawKernel(STREAM_KERNEL, "stream_read")
    chunk = 256 << 20
    bufs = [cp.random.default_rng(i).integers(0, 2**32, chunk // 4, dtype=cp.uint64).astype(cp.uint32)
            for i in range(copies_for_cold_l2(chunk, l2))]
    sink = cp.zeros(1, cp.uint32)

    def run(i: int) -> None:
        with stream:
            kernel((sms * 4,), (512,), (bufs[i], np.uint64(chunk // 16), sink))

    us = time_candidates({"stream": run}, len(bufs), CONFIG, CupyBackend(stream))["stream"].median_us
    return chunk / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--quick", action="store_true", help="three anchors only (smoke run)")
    args = ap.parse_args()
    timer = GpuTimer(CONFIG)
    prov = timer.provenance()
    props = {"name": prov.gpu_name, "sm_count": prov.sm_count, "l2_bytes": prov.l2_bytes}
    l2 = prov.l2_bytes
    t0 = time.time()
    ceiling = read_ceiling(l2, prov.sm_count, timer.stream)
    print(f"{props['name']}: read ceiling {ceiling:.0f} GB/s (16-byte streaming loads)", flush=True)
    backend = TorchBackend()
    anchors = ANCHORS[:3] if args.quick else ANCHORS
    cells = [("Q4_0", m, n, k) for n, k in anchors for m in Q4_0_M]
    cells += [(cb, 1, n, k) for n, k in anchors for cb in CODEBOOKS if cb != "Q4_0"]
    rows = []
    baselines: dict[tuple[int, int, int], dict[str, float]] = {}
    for codebook, m, n, k in cells:
        stats = time_ours(timer, codebook, m, n, k)
        best = min(stats, key=lambda c: stats[c].median_us)
        st, engines = stats[best], engine_bests(stats)
        nbytes = n * (k // 32) * get(codebook).block_bytes  # every plane once: the GGUF bytes
        if codebook == "Q4_0":
            baselines[(m, n, k)] = time_baselines(m, n, k, l2, backend)
        base = baselines.get((m, n, k), {})
        gbs = nbytes / st.median_us / 1e3
        row = {"codebook": codebook, "m": m, "n": n, "k": k, "best": best, "us": st.median_us, "p5_us": st.p5_us,
               "p95_us": st.p95_us, "weight_bytes": nbytes, "gbs": gbs, "of_ceiling": gbs / ceiling,
               **{f"{b}_us": v for b, v in base.items()},
               **{f"x_{b}": v / st.median_us for b, v in base.items()},
               **{f"best_{e}_us": v for e, v in engines.items()},
               "candidates_us": {c: stats[c].median_us for c in sorted(stats)}}
        rows.append(row)
        print(json.dumps({key: v for key, v in row.items() if key != "candidates_us"}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": props, "read_ceiling_gbs": ceiling, "config": CONFIG.__dict__,
                                    "seconds": time.time() - t0, "rows": rows}, indent=1) + "\n")
    print(f"\n{'codebook':8} {'M':>3} {'N':>7} {'K':>6} {'best':24} {'us':>8} {'GB/s':>6} {'ceil%':>6} "
          f"{'x tiny':>7} {'x fp16':>7} {'dp4a us':>8} {'mma us':>8}")
    for r in rows:
        tiny, fp16 = r.get("x_tinygemm_int4", math.nan), r.get("x_cublas_fp16", math.nan)
        print(f"{r['codebook']:8} {r['m']:>3} {r['n']:>7} {r['k']:>6} {r['best']:24} {r['us']:8.2f} "
              f"{r['gbs']:6.0f} {100 * r['of_ceiling']:6.1f} {tiny:7.2f} {fp16:7.2f} "
              f"{r.get('best_dp4a_us', math.nan):8.2f} {r.get('best_mma_us', math.nan):8.2f}")


if __name__ == "__main__":
    main()
