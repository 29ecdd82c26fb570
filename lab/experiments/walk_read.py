"""How fast can a kernel read a shape's weight planes in the order the GEMV walks them? (M = 1, no arithmetic)

    python lab/experiments/walk_read.py --codebooks Q4_K,IQ4_XS --shapes 27648x5120,5120x27648 --out walk.json

For each cell, one interleaved timing run (graph replay, cold L2 by rotation, medians: the sweep's harness) of
- `stream`: the streaming read of bench/kernels.py over the same number of bytes, best of a few grids;
- `walk.sS.tT.uU`: WALK_KERNEL, which reads every plane of random weights exactly as a dp4a launch of K split S
  and T threads per CTA does (thread = output column, blocks of its partition ascending, a super-block's payload
  rows and fields at a time, U super-blocks' loads issued before any is used) and only sums the words;
- the registry candidates named by --candidates (the GEMV itself, same run).
What a walk takes over the stream is what the layout and the walk order cost before any decode: the part of the
GEMV's gap to the read ceiling that no cheaper decode can close. Super-block codebooks only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
from gemv_dispatch.dispatch.measure.sweep import weight_copies
from gemv_dispatch.dispatch.measure.timing import CupyBackend, Launch, cell_seed, time_candidates
from gemv_dispatch.kernels import launch, program, ptxas
from gemv_dispatch.kernels.codebooks import SUPERBLOCK, SUPERBLOCK_WEIGHTS
from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.registry import Candidate, by_id

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the kernel benchmark's streaming read
from kernels import CONFIG, stream_reads

REFERENCE = "wide.s1.t128.c1.st"  # S = 1 in the registry: the bytes an S = 1 variant must give

WALK_KERNEL = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
// One E-byte entry at byte offset `at`, loaded as the GEMV loads it (E a plane's bytes per entry; 0: no plane).
template <int E>
__device__ __forceinline__ uint4 entry(const unsigned char* __restrict__ p, u64 at) {
    if constexpr (E == 16) {
        return __ldg(reinterpret_cast<const uint4*>(p + at));
    } else if constexpr (E == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p + at));
        return make_uint4(v.x, v.y, 0u, 0u);
    } else if constexpr (E == 12) {
        const u32* w = reinterpret_cast<const u32*>(p + at);
        return make_uint4(__ldg(w), __ldg(w + 1), __ldg(w + 2), 0u);
    } else if constexpr (E == 6) {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p + at);
        return make_uint4(__ldg(h), __ldg(h + 1), __ldg(h + 2), 0u);
    } else if constexpr (E == 4) {
        return make_uint4(__ldg(reinterpret_cast<const u32*>(p + at)), 0u, 0u, 0u);
    } else if constexpr (E == 2) {
        return make_uint4(__ldg(reinterpret_cast<const unsigned short*>(p + at)), 0u, 0u, 0u);
    } else {
        return make_uint4(0u, 0u, 0u, 0u);
    }
}
// Planes: payload [KB][N][PAY], high [KB][N][HIGH] (0: none), scale [KB/8][N][2], min [KB/8][N][MIN] and sub
// [KB/8][N][SUB]; a partition is `width` super-blocks. Every load of U super-blocks is issued before any is used.
template <int PAY, int HIGH, int MIN, int SUB, int U>
__global__ void __launch_bounds__(256, 1)
    walk_read(const unsigned char* __restrict__ payload, const unsigned char* __restrict__ high,
              const unsigned char* __restrict__ scale, const unsigned char* __restrict__ minv,
              const unsigned char* __restrict__ sub, int N, int KB, int width, u32* sink) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int sb_begin = blockIdx.y * width, sb_end = min(KB / 8, (blockIdx.y + 1) * width);
    u32 acc = 0;
    for (int sb0 = sb_begin; sb0 < sb_end; sb0 += U) {
        uint4 v[U][8 + 8 + 3];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int sb = min(sb0 + u, sb_end - 1);  // past the end: the last again (an L1 hit)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u64 at = (u64)(8 * sb + j) * N + n;
                v[u][j] = entry<PAY>(payload, at * PAY), v[u][8 + j] = entry<HIGH>(high, at * HIGH);
            }
            const u64 at = (u64)sb * N + n;
            v[u][16] = entry<2>(scale, at * 2), v[u][17] = entry<MIN>(minv, at * MIN);
            v[u][18] = entry<SUB>(sub, at * SUB);
        }
        uint4 f = make_uint4(0u, 0u, 0u, 0u);  // four sums (XOR into one chain let ptxas use loads one by one)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < 19; ++j) f.x += v[u][j].x, f.y += v[u][j].y, f.z += v[u][j].z, f.w += v[u][j].w;
        acc ^= f.x ^ f.y ^ f.z ^ f.w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the loads; practically never taken
}
"""
SB_BLOCKS = SUPERBLOCK_WEIGHTS // BLOCK  # WALK_KERNEL's 8 blocks a super-block
WALKS = [(1, 128, 1), (1, 128, 2), (1, 256, 1), (4, 128, 1), (8, 128, 1), (16, 128, 1), (16, 128, 2)]  # (S, T, U)


def entry_bytes(plane: Any, rows: int, n: int) -> int:
    return 0 if plane is None else plane.nbytes // (rows * n)


def walk_launches(copies: list[Any], stream: Any) -> dict[str, Launch]:
    """A launch of WALK_KERNEL per (S, T, U) of WALKS over the weight copies, on `stream`."""
    w = copies[0]
    kb = w.k // BLOCK
    widths = (entry_bytes(w.payload, kb, w.n), entry_bytes(w.high, kb, w.n), entry_bytes(w.min, kb // SB_BLOCKS, w.n),
              entry_bytes(w.sub, kb // SB_BLOCKS, w.n))
    names = {(s, t, u): f"walk_read<{', '.join(map(str, widths))}, {u}>" for s, t, u in WALKS}
    module = cp.RawModule(code=WALK_KERNEL, options=("--std=c++17",), name_expressions=sorted(set(names.values())))
    with stream:
        sink = cp.zeros(1, cp.uint32)
    zero = np.uint64(0)

    def run(kernel: Any, grid: tuple[int, int], threads: int, width: int, i: int) -> None:
        c = copies[i]
        planes = [zero if p is None else p for p in (c.payload, c.high, c.scale, c.min, c.sub)]
        with stream:
            kernel(grid, (threads,), (*planes, np.int32(c.n), np.int32(kb), np.int32(width), sink))

    launches = {}
    for (s, t, u), name in names.items():  # partitions of whole super-blocks (S as near as that allows)
        width = -(-kb // SB_BLOCKS // s)
        grid = (-(-w.n // t), -(-kb // SB_BLOCKS // width))
        launches[f"walk.s{s}.t{t}.u{u}"] = partial(run, module.get_function(name), grid, t, width)
    return launches


def cell_inputs(codebook: str, n: int, k: int, candidates: list[str], l2: int,
                stream: Any) -> tuple[list[Any], Any, Any]:
    """One cell's inputs on `stream`, from the sweep's seeds: random weights in copies for cold L2, one row of
    quantized activations, and a workspace for the kpar ones among `candidates` (None without)."""
    rng = cp.random.default_rng(cell_seed(codebook, n, k, CONFIG.seed))
    with stream:
        copies = weight_copies(codebook, n, k, rng, l2)
        x = cp.random.default_rng(cell_seed(codebook, 1, n, k)).standard_normal((1, k), dtype=cp.float32)
        qact = launch.quantize_activations(x, stream)
        need = max((by_id(c).workspace_bytes(1, n, k) for c in candidates), default=0)
        ws = launch.new_workspace(need, n) if need else None
    return copies, qact, ws


def stream_launches(copies: list[Any], sms: int, stream: Any) -> dict[str, Launch]:
    """bench/kernels.py's streaming read of the copies' bytes, at a few grids."""
    read = stream_reads(copies[0].nbytes, len(copies), stream)
    return {f"stream.g{g}": partial(read, g) for g in (sms * 2, sms * 4, sms * 8)}


def nan_output(n: int, stream: Any) -> Any:
    """An M = 1 output of N columns on `stream`, NaN until a launch writes it."""
    with stream:
        return cp.full((1, n), np.nan, cp.float32)


def bound(cands: dict[str, Candidate], copies: list[Any], qact: Any, ws: Any,
          stream: Any) -> tuple[dict[str, Launch], dict[str, Any]]:
    """A launch of each candidate (by name) over the copies into an output of its own (nan_output), by name."""
    outs = {name: nan_output(copies[0].n, stream) for name in cands}
    return {name: launch.bind(c, copies, qact, outs[name], stream, ws) for name, c in cands.items()}, outs


def checked_medians(codebook: str, n: int, k: int, launches: dict[str, Launch], outs: dict[str, Any],
                    s1: list[str], copies: list[Any], sms: int, stream: Any) -> dict[str, float]:
    """Each launch run once into its output (`outs`, by name; REFERENCE's among them); the launches named in `s1`
    (S = 1's identity) must give REFERENCE's bytes. Then one interleaved timing run of the launches and the streaming
    read of the copies' bytes (the sweep's harness, no racing): medians (µs) by name."""
    for fn in launches.values():
        fn(0)
    stream.synchronize()
    expected = cp.asnumpy(outs[REFERENCE]).view(np.uint32)
    for name in s1:
        if not np.array_equal(cp.asnumpy(outs[name]).view(np.uint32), expected):
            raise SystemExit(f"{codebook} {n}x{k} {name}: the output differs from {REFERENCE}'s (S = 1)")
    return medians(codebook, n, k, launches | stream_launches(copies, sms, stream), len(copies), stream)


def medians(codebook: str, n: int, k: int, launches: dict[str, Launch], copies: int, stream: Any) -> dict[str, float]:
    """One interleaved timing run of the launches over `copies` weight copies (the sweep's harness, no racing):
    medians (µs) by name."""
    stats = time_candidates(launches, copies, replace(CONFIG, race=False), CupyBackend(stream),
                            seed=cell_seed(codebook, 1, n, k))
    return {name: st.median_us for name, st in stats.items()}


def time_cell(codebook: str, n: int, k: int, candidates: list[str], l2: int, sms: int,
              stream: Any) -> dict[str, float]:
    """Medians (µs) of the stream, the walks and the candidates of one cell, timed in one interleaved run."""
    copies, qact, ws = cell_inputs(codebook, n, k, candidates, l2, stream)
    with stream:
        out = cp.empty((1, n), cp.float32)
    launches = stream_launches(copies, sms, stream) | walk_launches(copies, stream)
    for c in candidates:
        launches[c] = launch.bind(by_id(c), copies, qact, out, stream, ws)
    stream.synchronize()
    return medians(codebook, n, k, launches, len(copies), stream)


def build_appended(kernel_text: str, names: list[str]) -> tuple[Any, dict[str, int]]:
    """A module of the tree's kernel source with `kernel_text` appended (an experiment's kernels, which use its
    pieces), built with its options for the instantiations `names`, and each one's registers (one that spills is
    refused, as the certificate would refuse it)."""
    text = program.source() + kernel_text
    built = {r.name: r for r in ptxas.compile_parallel(names, text=text)}
    if spills := [r.describe() for r in built.values() if not r.spill_free]:
        raise SystemExit(f"spills: {'; '.join(spills)}")
    module = cp.RawModule(code=text, options=program.CONTRACT_OPTIONS, name_expressions=names)
    return module, {name: built[name].registers for name in names}


@dataclass(frozen=True)
class Variant:
    """One launch of an experiment's M = 1 kernel, which takes the GEMV's arguments and must give S = 1's bytes."""
    kernel: Any
    grid: int
    threads: int
    shared: int  # dynamic shared memory, bytes


def variant_medians(variants: dict[str, Variant], codebook: str, n: int, k: int, candidates: list[str], l2: int,
                    sms: int, stream: Any) -> dict[str, float]:
    """Medians (µs) of the variants (by name), the candidates and the stream of one cell, timed in one interleaved
    run after every variant's output and every S = 1 candidate's is checked against REFERENCE's."""
    kb = k // BLOCK
    copies, qact, ws = cell_inputs(codebook, n, k, candidates, l2, stream)
    tail = (*launch.storage(qact), np.int32(1), np.int32(n), np.int32(kb), np.int32(kb))

    def run(v: Variant, out: Any, i: int) -> None:
        v.kernel((v.grid,), (v.threads,), (*copies[i].plane_args(), *tail, out, np.uint64(0)), shared_mem=v.shared,
                 stream=stream)

    outs = {name: nan_output(n, stream) for name in variants}
    launches: dict[str, Launch] = {name: partial(run, v, outs[name]) for name, v in variants.items()}
    cands = {c: by_id(c) for c in dict.fromkeys([REFERENCE, *candidates])}
    cand_launches, cand_outs = bound(cands, copies, qact, ws, stream)
    s1 = [*variants, *(c for c, cand in cands.items() if cand.split(k) == 1)]
    return checked_medians(codebook, n, k, launches | cand_launches, outs | cand_outs, s1, copies, sms, stream)


def variants_study(description: str, build: Callable[[list[str]], tuple[Any, dict[str, int]]],
                   variants: Callable[[Any, str, int, int], dict[str, Variant]]) -> None:
    """An experiment's main: build(codebooks) -> (module, registers by name); variants(module, codebook, n, k) -> its
    launches of one cell, each timed beside the candidates and the stream (variant_medians, study)."""
    args = arguments(description, "variants")
    module, registers = build(args.codebooks.split(","))
    print("registers: " + ", ".join(f"{name} {r}" for name, r in registers.items()), flush=True)

    def time_one(codebook: str, n: int, k: int, candidates: list[str], l2: int, sms: int,
                 stream: Any) -> dict[str, float]:
        return variant_medians(variants(module, codebook, n, k), codebook, n, k, candidates, l2, sms, stream)

    study(args, time_one, registers=registers)


def arguments(description: str, timed: str) -> argparse.Namespace:
    """The options of the M = 1 studies (this, grid_balance.py and the S = 1 experiments of variants_study);
    `timed`: what the candidates are timed beside."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codebooks", default="Q4_K,IQ4_XS")
    ap.add_argument("--shapes", default="27648x5120,5120x27648")
    ap.add_argument("--candidates", default="wide.s1.t256.c1.st,kpar.s16.t128.c1.st",
                    help=f"registry candidates timed beside the {timed} (those invalid for a cell are left out)")
    ap.add_argument("--out", type=Path)
    return ap.parse_args()


def study(args: argparse.Namespace, time_one: Callable[..., dict[str, float]], **extra: Any) -> None:
    """Every (codebook, shape) of `args` timed by time_one(codebook, n, k, candidates, l2, sms, stream) -> medians
    (µs) by launch, printed fastest first as a share of the fastest stream launch, and written to --out with `extra`."""
    stream = cp.cuda.Stream(non_blocking=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    l2, sms = int(props["l2CacheSize"]), int(props["multiProcessorCount"])
    rows = []
    for codebook in args.codebooks.split(","):
        for n, k in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
            cands = [c for c in args.candidates.split(",") if by_id(c).valid(1, n, k)]
            us = time_one(codebook, n, k, cands, l2, sms, stream)
            stream_us = min(v for name, v in us.items() if name.startswith("stream"))
            rows.append({"codebook": codebook, "n": n, "k": k, "us": us, "stream_us": stream_us})
            print(f"{codebook} {n}x{k}: stream {stream_us:.2f} us; "
                  + ", ".join(f"{name} {v:.2f} ({stream_us / v:.0%})" for name, v in sorted(us.items(), key=by_time)
                              if not name.startswith("stream")), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"device": props["name"].decode(), **extra, "rows": rows}, indent=1)
                                    + "\n")


def by_time(item: tuple[str, float]) -> float:
    return item[1]


def main() -> None:
    args = arguments(__doc__, "walks")
    if other := [cb for cb in args.codebooks.split(",") if cb not in SUPERBLOCK]:
        raise SystemExit(f"{other[0]}: the walks read super-block planes only")
    study(args, time_cell)


if __name__ == "__main__":
    main()
