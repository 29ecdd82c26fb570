"""Experiment (not in the registry): M = 1 at S = 1 with L threads per output column instead of one.

    python lab/experiments/lanes_variant.py --codebooks Q4_K,IQ4_XS --shapes 27648x5120,5120x27648 --out lanes.json

`gemv_lanes<CB, L>` (LANES_KERNEL, appended to the tree's gemv.cu and built with its options) gives each output
column L adjacent threads ("lanes"): lane l decodes super-blocks l, l + L, ... of the column with the staged
super-block walk's own pieces (ColumnGroup<CB, 8>, block_chains, RowBlock::term), and after each round of L
super-blocks the lanes hand their 8 block terms each, in block order, to lane 0's chain by shuffles; so the bytes are
S = 1's (the contract's order), while the grid holds L times the warps of a wide launch. The CTA stages the
activation row first, as a staged wide launch does. IQ4_XS, Q4_K and Q5_K (the formats whose staged walk takes a
super-block at a time).

Per cell, after every variant's output is compared byte for byte with the registry's `wide.s1.t128.c1.st` (S = 1),
one interleaved timing run (the sweep's harness: graph replay, cold L2 by rotation, medians) of the variants, the
registry candidates named by --candidates and the streaming read of the same bytes (bench/kernels.py).
"""

from __future__ import annotations

from typing import Any

from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.registry import CODEBOOK_IDS, STAGED_BLOCK_BYTES
from walk_read import Variant, build_appended, variants_study

LANES_KERNEL = r"""
// M = 1, S = 1: L lanes per output column (adjacent threads of a warp); lane l walks super-blocks l, l + L, ...
template <int CB, int L>
__global__ void gemv_lanes(GEMV_PARAMS) {
    typedef Traits<CB> T;
    static_assert(T::SUPER && T::SPAN == 8 && 32 % L == 0, "a super-block walk; a column's lanes within a warp");
    constexpr bool SELECTOR_ORDER = T::TABLE, IN_PLACE = CB == Q4_K || CB == Q5_K;
    constexpr int ADDENDS = SELECTOR_ORDER || CB == Q5_K ? 2 : 1;
    DYNAMIC_SHARED(float, smem);  // the staged row: KB blocks of 32 values, then {d_a, staged word} each
    int4* stage_q = reinterpret_cast<int4*>(smem);
    int2* stage_ds = reinterpret_cast<int2*>(stage_q + 2 * KB);
    const Planes P{payload, high, scale, minv, sub};
    for (int i = threadIdx.x; i < KB; i += blockDim.x) {
        const int4* q = reinterpret_cast<const int4*>(qa) + 2 * i;  // M = 1: block i's row
        int4 q0 = __ldg(q), q1 = __ldg(q + 1);
        stage_ds[i] = make_int2(__float_as_int(__ldg(da + i)), RowBlock<CB>::staged_word(__ldg(sa + i), q0));
        if constexpr (SELECTOR_ORDER) to_selector_order(q0, q1);
        stage_q[2 * i] = q0, stage_q[2 * i + 1] = q1;
    }
    __syncthreads();
    const int lane = threadIdx.x % L, col = (blockIdx.x * blockDim.x + threadIdx.x) / L;
    const int c = min(col, N - 1);  // a column past N walks the last one: every lane takes part in the shuffles
    const int groups = KB / 8;
    float acc = 0.0f;
    for (int g0 = 0; g0 < groups; g0 += L) {
        const int grp = g0 + lane;
        float t[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (grp < groups) {
            ColumnGroup<CB, 8> w;
            w.template load<false>(P, grp, c, N, true, 0, KB);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int b = grp * 8 + u;
                int v[ADDENDS][8];
                float dw[T::HALVES], mw;
                w.template block<SELECTOR_ORDER, false, IN_PLACE>(u, b, v, dw, mw);
                const ActivationRow x = ActivationRow::staged(stage_q, stage_ds, b);
                const RowBlock<CB> row = RowBlock<CB>::of_staged(x.d_a, x.s_a);
                const int xq[8] = {x.q0.x, x.q0.y, x.q0.z, x.q0.w, x.q1.x, x.q1.y, x.q1.z, x.q1.w};
                int bias[T::HALVES], s[T::HALVES];
#pragma unroll
                for (int h = 0; h < T::HALVES; ++h) bias[h] = row.bias;
                const bool in_place = block_chains<CB, IN_PLACE, SELECTOR_ORDER>(v, xq, bias, u, b & 7, s);
                t[u] = row.term(s, dw, mw, in_place);
            }
        }
        // The round's blocks in ascending order: lane 0 (which alone stores) chains its own 8 terms, then those
        // of lanes 1 .., all shuffled before the first add (a shuffle per add put its latency on the chain).
        float from[L][8];
#pragma unroll
        for (int u = 0; u < 8; ++u) from[0][u] = t[u];
#pragma unroll
        for (int src = 1; src < L; ++src)
#pragma unroll
            for (int u = 0; u < 8; ++u) from[src][u] = __shfl_sync(0xffffffffu, t[u], src, L);
#pragma unroll
        for (int src = 0; src < L; ++src)
            if (g0 + src < groups)
#pragma unroll
                for (int u = 0; u < 8; ++u) acc = add_rn(acc, from[src][u]);
    }
    if (col < N && lane == 0) out[col] = add_rn(0.0f, acc);
}
"""
LANES = (1, 2, 4, 8)
THREADS = (128, 256)


def kernel_name(codebook: str, lanes: int) -> str:
    return f"gemv_lanes<{CODEBOOK_IDS[codebook]}, {lanes}>"


def build(codebooks: list[str]) -> tuple[Any, dict[str, int]]:
    """The module of every (codebook, L) variant, and each one's registers."""
    return build_appended(LANES_KERNEL, [kernel_name(cb, lanes) for cb in codebooks for lanes in LANES])


def variants(module: Any, codebook: str, n: int, k: int) -> dict[str, Variant]:
    """Every (L, threads) launch of the codebook's kernels for N x K."""
    return {f"lanes.l{lanes}.t{threads}": Variant(module.get_function(kernel_name(codebook, lanes)),
                                                  -(-n * lanes // threads), threads, STAGED_BLOCK_BYTES * (k // BLOCK))
            for lanes in LANES for threads in THREADS}


if __name__ == "__main__":
    variants_study(__doc__, build, variants)
