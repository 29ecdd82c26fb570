"""Experiment (not in the registry): M = 1 at S = 1 with a CTA's lanes decoding blocks in parallel and one fold warp.

    python lab/experiments/rowfold_variant.py --codebooks Q4_K,IQ4_XS --shapes 27648x5120,5120x27648 --out rowfold.json

`gemv_rowfold<CB, R, W>` (ROWFOLD_KERNEL, appended to the tree's gemv.cu and built with its options): a CTA owns R
adjacent output columns and all of K. Its W compute warps take the columns' groups (a super-block; Q6_K a quad) a
chunk of W * 32 / R groups at a time, lane l of warp w group w * 32 / R + l / R of the chunk for column l % R (so a
warp's loads of a block are 32 / R runs of R adjacent columns), load it with the staged walk's pieces (ColumnGroup,
block_chains, RowBlock::term; the activations from global memory, an L1 hit after the first CTA of the SM), and
leave each block's term in shared memory. Its fold warp's lanes 0..R-1 add the previous chunk's terms in block order
into their column's chain while the compute warps decode the next chunk (two buffers, a barrier a chunk), so the bytes
are S = 1's (the contract's order) while the grid holds N / R CTAs of W + 1 warps: the thread count no longer
follows N (row 62's lanes put the chain in the decoding warps; here no decoding lane waits on it).

Per cell, after every variant's output is compared byte for byte with the registry's `wide.s1.t128.c1.st` (S = 1),
one interleaved timing run (the sweep's harness: graph replay, cold L2 by rotation, medians) of the variants, the
registry candidates named by --candidates and the streaming read of the same bytes (bench/kernels.py).
"""

from __future__ import annotations

from typing import Any

from gemv_dispatch.kernels.registry import CODEBOOK_IDS, pipe_slot_bytes
from walk_read import Variant, build_appended, variants_study

ROWFOLD_KERNEL = r"""
constexpr int LANES = 32;  // threads a warp
// A lane's group: a super-block, Q6_K a quad; its cells in a ring slot (ColumnGroup::load's reads, as gemv.cu's ring
// takes them: 16-byte cells for payload rows and 8-byte values, 4-byte ones for the rest; registry.PIPE_GROUP_BYTES).
template <int CB>
struct Rowfold {
    typedef Traits<CB> T;
    static constexpr int G = CB == Q6_K ? T::GROUP : 8;
    static constexpr int WIDE = G * T::WORDS / 4 + (CB == Q6_K ? G + 1 : 0);
    static constexpr int NARROW = 1 + T::ASYM + (CB == Q6_K ? 0 : 3) + (CB == Q5_K ? 8 : 0);
    static constexpr int WARP_SLOT_BYTES = (16 * WIDE + 4 * NARROW) * LANES;  // a warp's cells of one group a lane
};
// A lane's cells of a slot: cell i lies i cells of a warp (the cell size times LANES) past its first, so a warp's
// copies and reads of a cell are consecutive. Copy sends each value ColumnGroup::load reads to the next cell by
// cp.async (a 4-byte cell takes the aligned word that holds a smaller value), Copied reads them back in that order.
// (gemv.cu's own ring readers, CopyTo and CopiedFrom, take their layout from its ring; this one is the experiment's.)
struct Cells {
    unsigned char* wide;
    unsigned char* narrow;
    int* used;  // {16-byte, 4-byte} cells so far
};
struct Copy {
    Cells c;
    template <typename V>
    __device__ __forceinline__ V operator()(const V* p) const {
        asm volatile("" ::: "memory");  // after this lane's earlier reads of the slot
        if constexpr (sizeof(V) >= 8)
            cp_async<sizeof(V)>(shared_at(c.wide + c.used[0]++ * 16 * LANES), p, true);
        else
            cp_async<4>(shared_at(c.narrow + c.used[1]++ * 4 * LANES), reinterpret_cast<const void*>((u64)p & ~(u64)3),
                        true);
        return V{};
    }
};
struct Copied {
    Cells c;
    template <typename V>
    __device__ __forceinline__ V operator()(const V* p) const {
        if constexpr (sizeof(V) >= 8) {
            return *reinterpret_cast<const V*>(c.wide + c.used[0]++ * 16 * LANES);
        } else {
            const u32 w = *reinterpret_cast<const u32*>(c.narrow + c.used[1]++ * 4 * LANES);
            return (V)(sizeof(V) == 2 ? w >> (8 * ((u64)p & 2)) : w);
        }
    }
};

template <int CB, int R, int W, bool RING>
__global__ void __launch_bounds__((W + 1) * LANES) gemv_rowfold(GEMV_PARAMS) {
    typedef Traits<CB> T;
    typedef Rowfold<CB> F;
    static_assert(T::SUPER && LANES % R == 0, "a super-block codebook; a warp holds whole runs of R columns");
    constexpr int G = F::G, H = T::HALVES, SPW = LANES / R, CHUNK = W * SPW, STRIDE = (G + 1) * R;
    constexpr bool SELECTOR_ORDER = T::TABLE, RAW6 = CB == Q6_K, IN_PLACE = CB == Q4_K || CB == Q5_K;
    constexpr int ADDENDS = SELECTOR_ORDER || CB == Q5_K ? 2 : 1;
    // Two chunks' terms [2][CHUNK][STRIDE] (STRIDE pads a group's G terms of R columns so that a warp's stores, 32 / R
    // groups of R columns, fall on 32 banks), then (RING) two slots of every compute warp's cells.
    DYNAMIC_SHARED(float, terms);
    unsigned char* const ring = reinterpret_cast<unsigned char*>(terms + 2 * CHUNK * STRIDE);
    if (dynamic_shared_bytes() < 4 * 2 * CHUNK * STRIDE + (RING ? 2 * W * F::WARP_SLOT_BYTES : 0)) __trap();
    const Planes P{payload, high, scale, minv, sub};
    const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES, col0 = blockIdx.x * R;
    const int groups = KB / G, chunks = (groups + CHUNK - 1) / CHUNK;
    const int s = warp * SPW + lane / R, col = min(col0 + lane % R, N - 1);  // a compute lane's group and column
    auto slot = [&](int k, int (&used)[2]) {
        unsigned char* at = ring + (k * W + warp) * F::WARP_SLOT_BYTES;
        return Cells{at + 16 * lane, at + 16 * F::WIDE * LANES + 4 * lane, used};
    };
    auto copy_chunk = [&](int ch) {  // chunk ch's group of this lane into slot ch % 2, then a commit
        if (ch < chunks && ch * CHUNK + s < groups) {
            int cells[2] = {0, 0};
            ColumnGroup<CB, G> copied;  // holds nothing: CopyTo reads zeros
            copied.template load<false>(P, ch * CHUNK + s, col, N, true, 0, KB, Copy{slot(ch & 1, cells)});
        }
        cp_async_commit();
    };
    if (RING && warp < W) copy_chunk(0);
    float acc = 0.0f;  // the fold lane's chain
    for (int ch = 0; ch <= chunks; ++ch) {
        if (warp < W) {
            const int grp = ch * CHUNK + s;
            if (RING) copy_chunk(ch + 1), cp_async_wait<1>();  // chunk ch's cells have landed
            if (ch < chunks && grp < groups) {
                float* t = terms + (ch & 1) * CHUNK * STRIDE + s * STRIDE + lane % R;
                ColumnGroup<CB, G> w;
                if constexpr (RING) {
                    int cells[2] = {0, 0};
                    w.template load<false>(P, grp, col, N, true, 0, KB, Copied{slot(ch & 1, cells)});
                } else {
                    w.template load<false>(P, grp, col, N, true, 0, KB);
                }
#pragma unroll
                for (int u = 0; u < G; ++u) {
                    const int b = grp * G + u;
                    int v[ADDENDS][8];
                    float dw[H], mw;
                    w.template block<SELECTOR_ORDER, RAW6, IN_PLACE>(u, b, v, dw, mw);
                    ActivationRow x = ActivationRow::load(qa, da, sa, (u64)b);
                    if constexpr (SELECTOR_ORDER) to_selector_order(x.q0, x.q1);
                    const RowBlock<CB> row = RowBlock<CB>::of(x.d_a, x.s_a);
                    const int xq[8] = {x.q0.x, x.q0.y, x.q0.z, x.q0.w, x.q1.x, x.q1.y, x.q1.z, x.q1.w};
                    int bias[H], sums[H];
                    if constexpr (RAW6) {
                        const int low = low_half_sum(x.q0);
                        bias[0] = MAGIC - Q6_K_OFFSET * low, bias[H - 1] = MAGIC - Q6_K_OFFSET * (x.s_a - low);
                    } else {
#pragma unroll
                        for (int h = 0; h < H; ++h) bias[h] = row.bias;
                    }
                    const bool in_place = block_chains<CB, IN_PLACE, SELECTOR_ORDER>(v, xq, bias, u, b & 7, sums);
                    t[u * R] = row.term(sums, dw, mw, in_place);
                }
            }
        } else if (ch > 0 && lane < R) {
            const float* t = terms + ((ch - 1) & 1) * CHUNK * STRIDE + lane;
            const int n = min(CHUNK, groups - (ch - 1) * CHUNK);
            for (int g = 0; g < n; ++g)
#pragma unroll
                for (int u = 0; u < G; ++u) acc = add_rn(acc, t[g * STRIDE + u * R]);
        }
        __syncthreads();  // the chunk's terms are written, the previous one's folded
    }
    if (warp == W && lane < R && col0 + lane < N) out[col0 + lane] = add_rn(0.0f, acc);
}
"""
VARIANTS = tuple((r, w, ring) for r in (8, 16, 32) for w in (4, 8) for ring in (False, True))  # (R, W, RING)


def kernel_name(codebook: str, r: int, w: int, ring: bool) -> str:
    return f"gemv_rowfold<{CODEBOOK_IDS[codebook]}, {r}, {w}, {str(ring).lower()}>"


def shared_bytes(codebook: str, r: int, w: int, ring: bool) -> int:
    """Two chunks' terms (a lane's group: Rowfold::G blocks), and with the ring two slots of every compute lane's
    cells: one group's, the staged walks' ring slot of a super-block codebook (registry.pipe_slot_bytes). The kernel
    traps on a launch that gives it less."""
    group = 4 if codebook == "Q6_K" else 8
    terms = 2 * 4 * w * (32 // r) * (group + 1) * r
    return terms + (2 * w * 32 * pipe_slot_bytes(codebook, 1) if ring else 0)


def build(codebooks: list[str]) -> tuple[Any, dict[str, int]]:
    """The module of every (codebook, R, W, RING) variant, and each one's registers."""
    return build_appended(ROWFOLD_KERNEL, [kernel_name(cb, *v) for cb in codebooks for v in VARIANTS])


def variants(module: Any, codebook: str, n: int, k: int) -> dict[str, Variant]:
    """Every (R, W, RING) launch of the codebook's kernels for N columns (a CTA per R of them)."""
    launches = {}
    for r, w, ring in VARIANTS:
        kernel = module.get_function(kernel_name(codebook, r, w, ring))
        kernel.max_dynamic_shared_size_bytes = shared = shared_bytes(codebook, r, w, ring)
        launches[f"rowfold.r{r}.w{w}" + (".ring" if ring else "")] = Variant(kernel, -(-n // r), 32 * (w + 1), shared)
    return launches


if __name__ == "__main__":
    variants_study(__doc__, build, variants)
