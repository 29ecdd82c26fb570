"""Kernel benchmark: best candidate per anchor shape and M vs the read ceiling, torch's int4 tinygemm and
cuBLAS fp16, and an end-to-end decode figure (Llama-3.1-8B's layer stack), all timed the same way in one run.

Every time is a CUDA-graph replay of R launches on one explicit stream, events recorded on that stream,
cold L2 by rotating weight copies past 3x the device's L2, interleaved rounds, medians
(dispatch.measure.timing). Weights are random codes with finite random scales: no zeros, no special values.

    python bench/kernels.py --plot bench/results/roofline-nvidia-h200.png

Results are kept per GPU model: by default bench/results/kernels-<gpu-slug>.json (`--out` elsewhere), with the
report (bench/kernels_report.py) written beside it as kernels-<gpu-slug>.md.

Rows: Q4_0 and Q8_0 at M in MS on every anchor, the super-block codebooks at M = 1 and 16, the other legacy
ones at M = 1; cuBLAS fp16 and tinygemm wherever M > 1 or the codebook is Q4_0 or Q8_0. End to end: the sum over one
Llama-3.1-8B decode step (q, k, v, o, gate, up, down x 32 layers + lm_head) of the best candidate's time per
shape, plus one activation quantization per distinct input (anchors.LLAMA_8B_QUANTIZED_PER_LAYER), at M = 1
and 16, against the same sum for tinygemm and cuBLAS fp16 (which take bf16 / fp16 activations as they are).
Floors, timed the same way: an empty kernel, and one thread reading one word of a cold 1 GiB buffer (the least a
launch that waits on DRAM once can take), under `floor_us`; the report (bench/kernels_report.py), printed last,
gives each small shape's time above the second. Per shape, `stream_us`: the same weight bytes read by a pure
streaming kernel (best of a few grids, cold L2), the time a GEMV of those bytes could take at best on this GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import cupy as cp
import kernels_report
import numpy as np
from anchors import (
    ANCHORS,
    LLAMA_8B_LAYER,
    LLAMA_8B_LAYERS,
    LLAMA_8B_LM_HEAD,
    LLAMA_8B_QUANTIZED_PER_LAYER,
)
from gemv_dispatch.dispatch.common.gpu import gpu_slug
from gemv_dispatch.dispatch.measure.sweep import GpuTimer, sweep_timing
from gemv_dispatch.dispatch.measure.timing import (
    CupyBackend,
    Launch,
    Rotation,
    Stats,
    copies_for_cold_l2,
    time_candidates,
)
from gemv_dispatch.kernels import launch
from gemv_dispatch.kernels.codebooks import CODEBOOKS, SUPERBLOCK, get
from gemv_dispatch.kernels.registry import by_id, candidates_for

MS = (1, 2, 4, 8, 16, 31)
M_CODEBOOKS = ("Q4_0", "Q8_0")  # the codebooks the small-batch targets name
RESULTS = Path(__file__).resolve().parent / "results"
SUPERBLOCK_MS = (1, 16)  # the super-block targets: M = 1 against the ceiling, M = 16 against cuBLAS fp16
E2E_MS = (1, 16)
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


FLOOR_KERNELS = r"""
extern "C" __global__ void empty_kernel() {}
// One word at a line chosen by the SM clock: a different line of the buffer at nearly every launch, so nearly every
// read misses L2 (no rotation of copies evicts one line), and no memory access comes before it.
extern "C" __global__ void read_cold_word(const unsigned* __restrict__ src, unsigned long long lines, unsigned* sink) {
    const unsigned long long line = (clock64() * 0x9E3779B97F4A7C15ull >> 24) % lines;
    const unsigned v = __ldcg(src + line * 32);
    if (v == 0x9E3779B9u) sink[0] = v;  // keeps the load; practically never taken
}
"""
COLD_BUFFER = 1 << 30  # bytes: 1 GiB, ~17x the H200's L2


def time_floors(stream: Any) -> dict[str, float]:
    """Device µs of an empty launch and of a one-word cold read, one thread each (graph replay, medians)."""
    module = cp.RawModule(code=FLOOR_KERNELS)
    empty, read = module.get_function("empty_kernel"), module.get_function("read_cold_word")
    with stream:
        src = cp.ones(COLD_BUFFER // 4, cp.uint32)
        sink = cp.zeros(1, cp.uint32)
    stream.synchronize()
    lines = np.uint64(COLD_BUFFER // 128)

    def run_empty(_: int) -> None:
        with stream:
            empty((1,), (1,), ())

    def run_read(_: int) -> None:
        with stream:
            read((1,), (1,), (src, lines, sink))

    # One copy: the clock picks the line, so the harness's rotation is not what keeps the read cold.
    single = replace(CONFIG, cold_l2=False)
    stats = time_candidates({"empty": run_empty, "cold_word": run_read}, 1, single, CupyBackend(stream))
    return {name: st.median_us for name, st in stats.items()}


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


STREAM_THREADS = 512


def stream_reads(nbytes: int, copies: int, stream: Any) -> Callable[[int, int], None]:
    """run(grid, i): STREAM_KERNEL on `stream`, `grid` CTAs of STREAM_THREADS reading copy i of `copies` random
    buffers of `nbytes` (rounded up to 16), which are written on that stream."""
    kernel = cp.RawKernel(STREAM_KERNEL, "stream_read")
    n16 = -(-nbytes // 16)
    with stream:
        bufs = [cp.random.default_rng(i).integers(0, 2**32, 4 * n16, dtype=cp.uint64).astype(cp.uint32)
                for i in range(copies)]
        sink = cp.zeros(1, cp.uint32)

    def run(grid: int, i: int) -> None:
        with stream:
            kernel((grid,), (STREAM_THREADS,), (bufs[i], np.uint64(n16), sink))
    return run


def stream_read_us(nbytes: int, grids: list[int], l2: int, stream: Any) -> float:
    """Device µs of STREAM_KERNEL reading `nbytes` (rounded up to 16) from rotating copies past 3x L2 (cold), the
    best median over launches of `grids` CTAs of STREAM_THREADS."""
    copies = copies_for_cold_l2(16 * -(-nbytes // 16), l2)
    read = stream_reads(nbytes, copies, stream)
    launches: dict[str, Launch] = {f"grid {g}": partial(read, g) for g in grids}
    stats = time_candidates(launches, copies, CONFIG, CupyBackend(stream))
    return min(st.median_us for st in stats.values())


def read_ceiling(l2: int, sms: int, stream: Any) -> float:
    """GB/s of a 16-byte-load streaming read over rotating 256 MiB buffers (> 3x L2 in rotation)."""
    chunk = 256 << 20
    return chunk / stream_read_us(chunk, [sms * 4], l2, stream) / 1e3


def stream_floor(nbytes: int, l2: int, sms: int, stream: Any) -> float:
    """Device µs of the streaming read of `nbytes` from cold L2, the best of a few grids (a few waves, and one or
    four loads per thread): what a kernel that only reads a shape's weight bytes takes at that size, ramp and tail
    included."""
    n16 = -(-nbytes // 16)
    grids = sorted({*(sms * c for c in (1, 2, 4, 8)), -(-n16 // (4 * STREAM_THREADS)), -(-n16 // STREAM_THREADS)})
    return stream_read_us(nbytes, grids, l2, stream)


def time_quantize(m: int, k: int, stream: Any) -> float:
    """Device µs of one activation quantization of float32 [M, K] (graph replay; the input is small: hot)."""
    with stream:
        x = cp.random.default_rng(k).standard_normal((m, k), dtype=cp.float32)
        qact = launch.empty_activations(m, k)
    stream.synchronize()
    quantize = launch.quantize_launch(cp.cuda.runtime.getDevice(), m, k // 32)
    args, handle = (x.data.ptr, *launch.storage(qact)), stream.ptr

    def run(_: int, held: Any = qact) -> None:  # held: the buffers `args` addresses
        quantize.launch(handle, args)

    stats = time_candidates({"quantize": run}, 1, replace(CONFIG, cold_l2=False), CupyBackend(stream))
    return stats["quantize"].median_us


def end_to_end(codebook: str, m: int, ours: Callable[[str, int, int, int], dict[str, Stats]],
               baseline: Callable[[int, int, int], dict[str, float]],
               quantize_us: Callable[[int, int], float]) -> dict[str, float]:
    """µs of one decode step of Llama-3.1-8B as a sum of per-shape times (module docstring), from the run's
    memoized measurements: a shape the table already timed is not timed again."""
    shapes = [*LLAMA_8B_LAYER.values(), LLAMA_8B_LM_HEAD]
    counts = [LLAMA_8B_LAYERS] * len(LLAMA_8B_LAYER) + [1]
    quantized = sum(LLAMA_8B_LAYERS * c * quantize_us(m, k) for k, c in LLAMA_8B_QUANTIZED_PER_LAYER.items())
    quantized += quantize_us(m, LLAMA_8B_LM_HEAD[1])
    gemv = sum(c * min(st.median_us for st in ours(codebook, m, *s).values()) for s, c in zip(shapes, counts,
                                                                                              strict=True))
    total = {"ours_gemv": gemv, "ours_quantize": quantized, "ours": gemv + quantized}
    for b in ("tinygemm_int4", "cublas_fp16"):
        total[b] = sum(c * baseline(m, *s)[b] for s, c in zip(shapes, counts, strict=True))
    return total


def plot_roofline(rows: list[dict[str, Any]], ceiling: float, path: Path) -> None:
    """Weight bytes vs time per row (log-log), one series per M, and the read-ceiling line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for m in sorted({r["m"] for r in rows}):
        pts = [(r["weight_bytes"], r["us"]) for r in rows if r["m"] == m]
        ax.scatter(*zip(*pts, strict=True), s=14, label=f"M = {m}")
    xs = np.geomspace(min(r["weight_bytes"] for r in rows) / 2, max(r["weight_bytes"] for r in rows) * 2, 50)
    ax.plot(xs, xs / ceiling / 1e3, "k-", lw=1, label=f"read ceiling {ceiling:.0f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="weight bytes", ylabel="µs per GEMV (graph replay, cold L2)",
           title="Best candidate per shape and M")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON results file (default: bench/results/kernels-<gpu-slug>.json); "
                    "the report is written beside it as .md")
    ap.add_argument("--plot", type=Path, help="roofline PNG (matplotlib)")
    ap.add_argument("--quick", action="store_true", help="three anchors, no end-to-end figure (smoke run)")
    args = ap.parse_args()
    timer = GpuTimer(CONFIG)
    prov = timer.provenance()
    props = {"name": prov.gpu_name, "sm_count": prov.sm_count, "l2_bytes": prov.l2_bytes}
    l2 = prov.l2_bytes
    t0 = time.time()
    ceiling = read_ceiling(l2, prov.sm_count, timer.stream)
    floors = time_floors(timer.stream)
    print(f"{props['name']}: read ceiling {ceiling:.0f} GB/s (16-byte streaming loads); floors: empty launch "
          f"{floors['empty']:.2f} µs, one cold word {floors['cold_word']:.2f} µs", flush=True)
    backend = TorchBackend()
    anchors = ANCHORS[:3] if args.quick else ANCHORS
    cells = [(cb, m, n, k) for cb in M_CODEBOOKS for n, k in anchors for m in MS]
    cells += [(cb, m, n, k) for cb in SUPERBLOCK for n, k in anchors if k % get(cb).weights == 0 for m in SUPERBLOCK_MS]
    cells += [(cb, 1, n, k) for n, k in anchors for cb in CODEBOOKS if cb not in M_CODEBOOKS + SUPERBLOCK]
    rows = []

    # One measurement per cell, shape and quantization in the run: the table and the end-to-end sum share them.
    @cache
    def ours(codebook: str, m: int, n: int, k: int) -> dict[str, Stats]:
        return time_ours(timer, codebook, m, n, k)

    @cache
    def baseline(m: int, n: int, k: int) -> dict[str, float]:
        return time_baselines(m, n, k, l2, backend)

    @cache
    def quantize_us(m: int, k: int) -> float:
        return time_quantize(m, k, timer.stream)

    @cache
    def stream_us(nbytes: int) -> float:
        return stream_floor(nbytes, l2, prov.sm_count, timer.stream)

    for codebook, m, n, k in cells:
        stats = ours(codebook, m, n, k)
        best = min(stats, key=lambda c: stats[c].median_us)
        st, engines = stats[best], engine_bests(stats)
        nbytes = n * (k // get(codebook).weights) * get(codebook).block_bytes  # every plane once: the GGUF bytes
        base = baseline(m, n, k) if codebook in M_CODEBOOKS or m > 1 else {}
        gbs = nbytes / st.median_us / 1e3
        row = {"codebook": codebook, "m": m, "n": n, "k": k, "best": best, "us": st.median_us, "p5_us": st.p5_us,
               "p95_us": st.p95_us, "weight_bytes": nbytes, "gbs": gbs, "of_ceiling": gbs / ceiling,
               "ceiling_us": nbytes / ceiling / 1e3, "stream_us": stream_us(nbytes),
               **{f"{b}_us": v for b, v in base.items()},
               **{f"x_{b}": v / st.median_us for b, v in base.items()},
               **{f"best_{e}_us": v for e, v in engines.items()},
               "candidates_us": {c: stats[c].median_us for c in sorted(stats)}}
        rows.append(row)
        print(json.dumps({key: v for key, v in row.items() if key != "candidates_us"}), flush=True)
    e2e = {} if args.quick else {f"{cb} M={m}": end_to_end(cb, m, ours, baseline, quantize_us)
                                  for cb in M_CODEBOOKS for m in E2E_MS}
    out = args.out or RESULTS / f"kernels-{gpu_slug(prov.gpu_name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"device": props, "read_ceiling_gbs": ceiling, "floor_us": floors, "config": CONFIG.__dict__,
            "seconds": time.time() - t0, "rows": rows, "end_to_end_us": e2e}
    out.write_text(json.dumps(data, indent=1) + "\n")
    if args.plot:
        plot_roofline(rows, ceiling, args.plot)
    text = kernels_report.report(data, os.path.relpath(out))  # the report names it as typed from here
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
