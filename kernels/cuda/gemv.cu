// Quantized GEMV candidates (docs/contract.md §1-3), one source for every family and codebook.
//
// Two engines compute the per-block integer dot products; the threads of K partition p walk blocks
// [p*w, min(KB,(p+1)*w)):
//   gemv_partial<CB, CPT, MT, GRID_SPLIT>  dp4a, a thread owns CPT outputs and MT rows
//     wide    in-CTA, S = 1                      (p = threadIdx.y = 0)
//     direct  in-CTA, S >= 2 partitions          (p = threadIdx.y), partials meet in shared memory
//     kpar    GRID_SPLIT, S partitions over CTAs (p = blockIdx.y), partials to workspace [S][M][N], folded in
//             the same launch by the last CTA of each column range (fold_last)
//   gemv_staged<CB, CPT, GRID_SPLIT>  gemv_partial at M = 1 with the activation row staged per CTA in shared memory
//   gemv_mma<CB, NT, MTILES, GRID_SPLIT, THREADS, WEIGHTS_A>  int8 tensor cores, a warp owns 8*NT outputs; wide and
//     kpar; operands through a cp.async ring in shared memory (mma_ring)
//   quantize_activations: x float32 [M][K] -> q int8 [KB][M][32], d_a float [KB][M], sum_a int [KB][M]
//     (block-major like the weights: the M rows of one block are adjacent, so a warp's fragment loads coalesce)
//
// Arithmetic identity: every float operation is one IEEE fp32 rounding, written as explicit PTX (add.rn,
// mul.rn, div.rn, cvt.rni, abs, max, min without .ftz): never contracted into FMA, and immune to the
// compiler's flush-to-zero flag, which CuPy forces on (-ftz=true) for every NVRTC build. Block dot
// products are exact int32 (dp4a or mma); accumulation order is fixed by the contract (ascending blocks
// inside a partition, then ascending partitions from 0.0f). Launch parameters (engine, tiles, threads,
// family) therefore never change a bit of the output.
//
// Super-block formats: a block's scale (and min) derive from the super-block's fp16 d (dmin) and its integer
// sub-block scales, each product exact in fp32 (§2), so where a kernel derives them cannot change a bit.
// Their payload rows pair up: a Q4_K/Q5_K row of 16 bytes carries nibbles of two blocks, a Q6_K quad of rows
// four blocks, so those kernels walk K in groups of 2 (4) blocks that share their loads, and skip the group's
// blocks outside the partition.
//
// With GEMV_HOSTSIM defined the float operations and warp-wide instructions compile to host twins (the same
// single IEEE roundings, -ffp-contract=off), so tests/hostsim runs these kernels on a CPU.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// Indices follow kernels.codebooks.CODEBOOKS (tests/test_compile.py checks them, and Traits field by field).
enum Codebook { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, IQ4_NL = 5, Q4_K = 6, Q5_K = 7, Q6_K = 8, IQ4_XS = 9 };

template <int CB>
struct Traits {
    static constexpr bool SUPER = CB >= Q4_K;                                  // scales from super-block planes
    static constexpr int WORDS = CB == Q8_0 ? 8 : 4;                           // payload u32 words per row
    static constexpr int GROUP = CB == Q4_K || CB == Q5_K ? 2 : (CB == Q6_K ? 4 : 1);  // blocks sharing rows
    static constexpr bool ASYM = CB == Q4_1 || CB == Q5_1 || CB == Q4_K || CB == Q5_K;  // a min per block
    // The K-quants' min is -(dmin * m) (§2): the kernels hold dmin * m as m_w and subtract its term, which gives the
    // same bits as adding the negated term (round to nearest even is symmetric) without a sign flip per block.
    static constexpr bool MIN_SUBTRACTED = ASYM && SUPER;
    static constexpr bool HIGH = CB == Q5_0 || CB == Q5_1;                     // u32 high-bit plane per block
    static constexpr bool TABLE = CB == IQ4_NL || CB == IQ4_XS;                // IQ4_NL kvalues of the nibble
    static constexpr int OFFSET = CB == Q4_0 ? 8 : (CB == Q5_0 ? 16 : 0);      // code = stored value - OFFSET
    static constexpr int HALVES = CB == Q6_K ? 2 : 1;                          // scales per block
    // Blocks whose sub-block scales a column holds at once (SubScales: Q4_K/Q5_K 12 bytes, IQ4_XS 6, Q6_K the 8
    // of a quad).
    static constexpr int SPAN = CB == Q6_K ? 4 : 8;
    // A super-block column's sub-block scale record (the GGUF sc bytes; 0: no super-blocks).
    static constexpr int SUB_BYTES = CB == IQ4_XS ? 6 : CB == Q6_K ? 16 : CB == Q4_K || CB == Q5_K ? 12 : 0;
    // Columns a dp4a thread decodes at once: a paired format's group holds 2-4 payload rows (and Q5_K the
    // super-block's 8 qh words) per column, so those walk their CPT columns one (Q6_K) or two at a time.
    static constexpr int COLUMNS = CB == Q6_K ? 1 : (GROUP > 1 ? 2 : 16);
};

#ifndef GEMV_HOSTSIM
#define F32_BINARY(name, op, host)                                     \
    __device__ __forceinline__ float name(float a, float b) {          \
        float r;                                                       \
        asm(op " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));             \
        return r;                                                      \
    }
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#else
// PTX float operations return the canonical NaN 0x7FFFFFFF; x86 returns an operand's NaN or 0xFFC00000.
inline float canonical(float r) { return r != r ? __uint_as_float(0x7FFFFFFFu) : r; }
#define F32_BINARY(name, op, host) \
    inline float name(float a, float b) { return canonical(host); }
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(hostsim::self().shared)
#endif
F32_BINARY(add_rn, "add.rn.f32", a + b)
F32_BINARY(sub_rn, "sub.rn.f32", a - b)
F32_BINARY(mul_rn, "mul.rn.f32", a * b)
F32_BINARY(div_rn, "div.rn.f32", a / b)
F32_BINARY(max_f32, "max.f32", std::fmax(a, b))
F32_BINARY(min_f32, "min.f32", std::fmin(a, b))

#ifndef GEMV_HOSTSIM
__device__ __forceinline__ float abs_f32(float a) {
    float r;
    asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ float rint_f32(float a) {  // round half to even
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ int to_int_rz(float a) {
    int r;
    asm("cvt.rzi.s32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ float half_bits_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));  // exact, subnormals kept
    return f;
}

// dp4a.u32.s32: c plus the dot product of a's bytes read unsigned and b's signed. (The host twin is in tests/hostsim.)
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// prmt.b32, default mode: byte i of the result is byte s_i & 7 of {b, a} (a bytes 0-3), or with s_i & 8 that byte's
// sign replicated; only bits 0-15 of s are read. (The host twin is in tests/hostsim.)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// Asks for p's line in L2 and waits for nothing (no register, no result).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" : : "l"(p)); }
#else
inline void prefetch_l2(const void*) {}
inline float abs_f32(float a) { return std::fabs(a); }
inline float rint_f32(float a) { return std::nearbyint(a); }
inline int to_int_rz(float a) { return a != a ? 0 : (int)a; }  // only ever sees |a| <= 127
inline float half_bits_to_float(u16 h) { return hostsim_half_to_float(h); }
#endif

// A constant x as a per-thread value (threadIdx.x < 1024, so the added shift is 0): ptxas keeps it in a register,
// where it re-makes a constant from a uniform register before every use that needs one (a PRMT's first source).
__device__ __forceinline__ u32 held(u32 x) { return x + (threadIdx.x >> 10); }

// Asynchronous copies to shared memory (the ring, mma_ring; the staged walks, CopyTo) of BYTES (16: .cg, past L1; 8
// and 4: .ca, their only form); a copy from an invalid source zero-fills (src-size 0). They take the address in the
// shared state space (bytes), made once per CTA: converting a generic pointer per copy cost the ring's chunk issue ~2
// instructions a piece. The wait orders the thread's later shared-memory reads after it ("memory"): the staged walks
// read back their own copies with no barrier between. The host simulator addresses bytes directly.
#ifndef GEMV_HOSTSIM
typedef u32 SharedBytes;
__device__ __forceinline__ SharedBytes shared_at(const void* p) { return (u32)__cvta_generic_to_shared(p); }
template <int BYTES>
__device__ __forceinline__ void cp_async(SharedBytes to, const void* gmem, bool valid) {
    static_assert(BYTES == 16 || BYTES == 8 || BYTES == 4, "cp.async copies 16, 8 or 4 bytes");
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(gmem), "r"(valid ? 16 : 0));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(to), "l"(gmem), "n"(BYTES),
                     "r"(valid ? BYTES : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ u32 dynamic_shared_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
#else  // the host's copies complete at once
typedef unsigned char* SharedBytes;
inline SharedBytes shared_at(const void* p) { return (SharedBytes)p; }
template <int BYTES>
inline void cp_async(SharedBytes to, const void* gmem, bool valid) {
    valid ? (void)std::memcpy(to, gmem, BYTES) : (void)std::memset(to, 0, BYTES);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
inline u32 dynamic_shared_bytes() { return (u32)hostsim::self().shared_bytes; }
#endif

// How ColumnGroup::load reads a value of the weight planes: a load (Ldg), or a prefetch to L2 that reads nothing and
// gives zero (PrefetchL2: the same addresses, ahead of their loads).
struct Ldg {
    template <typename V>
    __device__ __forceinline__ V operator()(const V* p) const { return __ldg(p); }
};
struct PrefetchL2 {
    template <typename V>
    __device__ __forceinline__ V operator()(const V* p) const {
        prefetch_l2(p);
        return V{};
    }
};

// The staged walks' ring (dp4a_partial, PIPE): CopyTo sends each value a batch's loads read to the next cell of the
// thread's slot by cp.async, CopiedFrom reads them back in the same order. 16- and 8-byte values (payload rows; Q6_K's
// high words and quad scales) take 16-byte cells, smaller ones the aligned 4-byte word that holds them (an fp16
// value: the half its address picks; N even, so the word lies in its plane). A thread's cells are `step` bytes apart
// (threads x 16, threads x 4), so a warp's copies and reads of a cell are consecutive.
struct RingSlot {
    unsigned char* wide;    // the thread's first 16-byte cell
    unsigned char* narrow;  // its first 4-byte cell
    u32 wide_step, narrow_step;
};
struct CopyTo {
    SharedBytes wide, narrow;
    u32 wide_step, narrow_step;
    int* cells;  // {16-byte, 4-byte} cells used so far
    // The slot's copies follow the thread's earlier reads of it (CopiedFrom) in program order: the compiler may not
    // sink a read below them (cp.async declares no memory access of its own).
    __device__ __forceinline__ CopyTo(const RingSlot& s, int (&used)[2])
        : wide(shared_at(s.wide)), narrow(shared_at(s.narrow)), wide_step(s.wide_step), narrow_step(s.narrow_step),
          cells(used) {
        asm volatile("" ::: "memory");
    }
    template <typename V>
    __device__ __forceinline__ V operator()(const V* p) const {
        static_assert(sizeof(V) == 16 || sizeof(V) == 8 || sizeof(V) <= 4, "a cell holds 16, 8 or 4 bytes");
        if constexpr (sizeof(V) >= 8)
            cp_async<sizeof(V)>(wide + cells[0]++ * wide_step, p, true);
        else
            cp_async<4>(narrow + cells[1]++ * narrow_step, reinterpret_cast<const void*>((u64)p & ~(u64)3), true);
        return V{};
    }
};
struct CopiedFrom {
    RingSlot s;
    int* cells;
    template <typename V>
    __device__ __forceinline__ V operator()(const V* p) const {
        if constexpr (sizeof(V) >= 8) {
            return *reinterpret_cast<const V*>(s.wide + cells[0]++ * s.wide_step);
        } else {
            const u32 w = *reinterpret_cast<const u32*>(s.narrow + cells[1]++ * s.narrow_step);
            return (V)(sizeof(V) == 2 ? w >> (8 * ((u64)p & 2)) : w);
        }
    }
};

// An exact small integer (a sub-block scale) as float: cvt.rn.f32.s32 has no flushing variant to fear.
__device__ __forceinline__ float int_to_float(int i) { return (float)i; }

// Row-major index r * n + c of a [rows][n] plane, in 32 bits (the registry refuses planes of 2^32 entries or more:
// kernels.registry.MAX_PLANE_ENTRIES): each address is one IMAD.WIDE.U32 from its base where a 64-bit index took
// ~5 instructions. The tensor-core engine's loads use it (they ran 0.80-0.99x the time); the dp4a engine keeps 64-bit
// indices: with 32-bit ones its M = 1 loop issued ~20 fewer instructions per block yet ran up to 1.2x slower
// (lab/journal.md).
__device__ __forceinline__ u32 block_index(int r, int n, int c) { return (u32)r * (u32)n + (u32)c; }

// Bits 0..3 of h become bit 4 of bytes 0..3 (the fifth bit of four consecutive Q5 values).
// One multiply: bit j of (h & 15) lands at bits 4 + 7j + {0, 7, 14, 21}; the copies of the four bits occupy
// disjoint bit ranges (4..7, 11..14, 18..21, 25..28), so the sum carries nowhere and bit 4 + 8j is bit j.
__device__ __forceinline__ u32 high_bits_to_bytes(u32 h) { return ((h & 0xFu) * 0x02040810u) & 0x10101010u; }

// IQ4_NL: the 16 int8 kvalues of the nibble table, little-endian in four words. prmt picks a table byte by a selector
// nibble's bits 0-2 and replicates its sign where bit 3 is set: nibbles 0..7 index the first half as they are (the
// bytes 8..15 give there are discarded by the pick), nibbles 8..15 index the second half once bit 3 is cleared, and
// the pick takes byte k of the first or of the second half by bit 3. A word's selectors are made once for both its
// halves (__byte_perm would clear bit 3 of every selector again: one more instruction per call).
// The values of payload word k in its nibbles' order: r[0] = elements 4k, 16+4k, 4k+1, 17+4k; r[1] = 4k+2, 18+4k,
// 4k+3, 19+4k (SELECTOR_ORDER pairs them with activations staged in that order).
// IQ4NL_i: kvalues i..i+3.
constexpr u32 IQ4NL_0 = 0xBFAD9881u, IQ4NL_4 = 0xF6EADDCFu, IQ4NL_8 = 0x26190D01u, IQ4NL_12 = 0x71594535u;
__device__ __forceinline__ void iq4nl_pairs(u32 w, u32 (&r)[2]) {
    const u32 t0 = held(IQ4NL_0), t1 = IQ4NL_4, t2 = held(IQ4NL_8), t3 = IQ4NL_12;
    const u32 second = w & 0x77777777u;
    const u32 pick = ((w >> 1) & 0x44444444u) | 0x32103210u;
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // the nibbles of bytes 2i and 2i+1 (low, high, low, high); prmt reads bits 0-15
        const int s = 16 * i;
        r[i] = prmt(prmt(t0, t1, w >> s), prmt(t2, t3, second >> s), pick >> s);
    }
}

__device__ __forceinline__ void iq4nl_lookup(u32 w, u32& lo, u32& hi) {
    u32 r[2];
    iq4nl_pairs(w, r);
    lo = prmt(r[0], r[1], 0x6420u);  // values of elements 4k..4k+3
    hi = prmt(r[0], r[1], 0x7531u);  // values of elements 16+4k..16+4k+3
}

// The values of payload word k as two addends in iq4nl_pairs' order, with no pick between the table's halves: low
// holds kvalue n of nibbles n < 8 and -1 for the others (kvalues 0..7 are negative, so prmt's sign fill gives -1),
// high holds kvalue n + 1 of nibbles n >= 8 and 0 for the others (bit 3 flipped: kvalues 8..15 plus 1 are positive,
// their sign fill 0). Their sum is the kvalue, so a block's dot product takes a dp4a of each (4 prmt, 3 shifts or
// flips and 4 dp4a a word, where iq4nl_pairs' pick costs 6 prmt, 7 others and 2 dp4a).
__device__ __forceinline__ void iq4nl_addends(u32 w, u32 (&low)[2], u32 (&high)[2]) {
    const u32 l0 = held(IQ4NL_0), h0 = held(IQ4NL_8 + 0x01010101u), h1 = IQ4NL_12 + 0x01010101u;  // no byte carries
    const u32 flip = w ^ 0x88888888u;
    low[0] = prmt(l0, IQ4NL_4, w), low[1] = prmt(l0, IQ4NL_4, w >> 16);
    high[0] = prmt(h0, h1, flip), high[1] = prmt(h0, h1, flip >> 16);
}

// The lookup codebooks' staged activations (gemv_staged) in iq4nl_pairs' order: a block's words k = 0..3 of each
// half (q0[k]: elements 4k.., q1[k]: 16+4k..) become words 2k, 2k+1 of elements 4k, 16+4k, 4k+1, 17+4k and 4k+2,
// 18+4k, 4k+3, 19+4k. A block's dot product is an integer sum, so any order of its terms gives its bytes; staged
// once per CTA, the order spares every column's decode two prmt per word.
// Words k of the two halves (elements 4k.. and 16+4k..) in that order, in place: the ring's fragments (k = t).
__device__ __forceinline__ void to_selector_pair(int& lo, int& hi) {
    const u32 a = (u32)lo, b = (u32)hi;
    lo = (int)prmt(a, b, 0x5140u), hi = (int)prmt(a, b, 0x7362u);
}

__device__ __forceinline__ void to_selector_order(int4& q0, int4& q1) {
    int r[8] = {q0.x, q1.x, q0.y, q1.y, q0.z, q1.z, q0.w, q1.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) to_selector_pair(r[2 * k], r[2 * k + 1]);
    q0 = make_int4(r[0], r[1], r[2], r[3]);
    q1 = make_int4(r[4], r[5], r[6], r[7]);
}

// Four unsigned 6-bit codes (one per byte) minus Q6_K_OFFSET, as int8 bytes: flipping bit 5 gives the 6-bit two's
// complement of u - 32, which the multiply by 6 sign-extends into bits 6 and 7 (0x20 * 6 = 0xC0, no carry). The mma
// engine centres its B words so; the dp4a engine takes the codes (0..63, the same as int8) and starts each half's
// chain 32 times the half's activation sum lower, 4 dp4a per block and row where centring cost 4 instructions a word.
constexpr int Q6_K_OFFSET = 32;
__device__ __forceinline__ u32 centre6(u32 u) {
    const u32 y = u ^ 0x20202020u;
    return y | ((y & 0x20202020u) * 6u);
}

// Elements 4k..4k+3 (lo) and 16+4k..16+4k+3 (hi) of a legacy block as int8 words, in activation order.
// `w` is payload word k; Q8_0, one element per byte, passes word k+4 as `w_hi`. IN_PLACE (Q4_0, Q4_1): hi holds the
// high nibbles where they lie, 16 times their codes (see IN_PLACE_MAGIC).
template <int CB, bool IN_PLACE = false>
__device__ __forceinline__ void decode_word(u32 w, u32 w_hi, u32 high, int k, int& lo, int& hi) {
    static_assert(!IN_PLACE || CB == Q4_0 || CB == Q4_1, "only a bare nibble stays in place");
    if (CB == Q8_0) {
        lo = (int)w, hi = (int)w_hi;
    } else if (Traits<CB>::TABLE) {
        u32 l, h;
        iq4nl_lookup(w, l, h);
        lo = (int)l, hi = (int)h;
    } else {
        u32 l = w & 0x0F0F0F0Fu, h = IN_PLACE ? w & 0xF0F0F0F0u : (w >> 4) & 0x0F0F0F0Fu;
        if (Traits<CB>::HIGH) {
            l |= high_bits_to_bytes(high >> (4 * k));
            h |= high_bits_to_bytes(high >> (16 + 4 * k));
        }
        lo = (int)l, hi = (int)h;
    }
}

// Word k of block u of a group, for the paired formats: `w0`, `w1` are word k of the two payload rows that hold
// the block's elements 0..15 and 16..31; `h0`, `h1` the code bits above the nibble for those elements, already in
// place (bit 4, and bit 5 for Q6_K) of each byte. Q4_K/Q5_K block u takes nibble u of rows 0, 1 of the pair;
// Q6_K block u nibble u/2 of rows 2(u%2), 2(u%2)+1 of the quad, its codes centred (minus 32) unless RAW6 (the dp4a
// engine takes the 6-bit codes as they are: see Q6_K_OFFSET). IN_PLACE (Q4_K, Q5_K): nibble u where it lies, 16^u
// times itself (see IN_PLACE_MAGIC).
template <int CB, bool RAW6 = false, bool IN_PLACE = false>
__device__ __forceinline__ void decode_paired(u32 w0, u32 w1, u32 h0, u32 h1, int u, int& lo, int& hi) {
    static_assert(!IN_PLACE || CB == Q4_K || CB == Q5_K, "only a nibble stays in place");
    const int shift = CB == Q6_K ? 4 * (u >> 1) : 4 * u;
    const u32 nibbles = 0x0F0F0F0Fu << shift;
    u32 l = (IN_PLACE ? w0 & nibbles : (w0 >> shift) & 0x0F0F0F0Fu) | h0;
    u32 h = (IN_PLACE ? w1 & nibbles : (w1 >> shift) & 0x0F0F0F0Fu) | h1;
    if (CB == Q6_K && !RAW6) l = centre6(l), h = centre6(h);
    lo = (int)l, hi = (int)h;
}

// The bit of Q5_K block j (of its super-block) for four consecutive elements, from their qh word, at bit 4:
// a rotation right by j - 4 (one funnel shift, no bit lost) moves bit j + 8i to bit 4 + 8i.
__device__ __forceinline__ u32 q5k_high(u32 qh, int j) { return __funnelshift_r(qh, qh, (j - 4) & 31) & 0x10101010u; }
// The two bits of Q6_K block u (of its quad) for four consecutive elements, from their qh word, at bits 4-5.
__device__ __forceinline__ u32 q6k_high(u32 qh, int u) { return ((qh >> (2 * u)) & 0x03030303u) << 4; }

// Sub-block scale bytes of one super-block column, as the kernels hold them (little-endian words).
struct SubScales {
    u32 w[4];

    // Q4_K/Q5_K (GGUF get_scale_min): 6-bit scale and min of block j. UNPACKED (k6_unpacked): byte j of w[0..1]
    // is the scale of block j, of w[2..3] its min, so block j costs a select and a prmt each (byte j & 3 beside
    // three zero bytes; shift and mask took two instructions for bytes 1-3).
    template <bool UNPACKED>
    __device__ __forceinline__ void k6(int j, int& scale, int& min) const {
        if (UNPACKED) {
            const u32 byte = 0x4440u | (j & 3);
            scale = (int)prmt(j & 4 ? w[1] : w[0], 0u, byte), min = (int)prmt(j & 4 ? w[3] : w[2], 0u, byte);
        } else if (j < 4) {
            scale = (w[0] >> (8 * j)) & 63, min = (w[1] >> (8 * j)) & 63;
        } else {
            const int s = 8 * (j - 4);
            const u32 md = (w[2] >> s) & 0xFFu;
            scale = (md & 0xF) | (((w[0] >> (s + 6)) & 3) << 4);
            min = (md >> 4) | (((w[1] >> (s + 6)) & 3) << 4);
        }
    }
    // The 12 packed bytes (w[0..2]) as k6<true> reads them, for all 8 blocks at once: bytes 0-3 hold scales (and
    // mins, in bytes 4-7) 0-3 in their low 6 bits and the top 2 bits of 4-7, whose low 4 bits are bytes 8-11's nibbles.
    // The dp4a engine unpacks once per super-block; the ring's derive pass reads the packed bytes once per block.
    __device__ __forceinline__ SubScales k6_unpacked() const {
        const u32 a = w[0], b = w[1], c = w[2];
        return SubScales{{a & 0x3F3F3F3Fu, (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u), b & 0x3F3F3F3Fu,
                          ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)}};
    }
    // IQ4_XS: w[0] = scales_h (16 bits), w[1] = scales_l (32 bits); the 6-bit scale minus 32 of block j.
    __device__ __forceinline__ int xs(int j) const {
        return (int)(((w[1] >> (4 * j)) & 0xF) | (((w[0] >> (2 * j)) & 3) << 4)) - 32;
    }
    // Q6_K, holding the 8 scale bytes of block j's quad: the int8 scale of half h of block j (the word chosen by a
    // select: j is no compile-time constant, and an indexed register array would go to local memory).
    __device__ __forceinline__ int q6(int j, int h) const {
        return (int)(signed char)((j & 2 ? w[1] : w[0]) >> (8 * (2 * (j & 1) + h)));
    }
};

// The sub-block scale record at `p` of IQ4_XS (6 bytes: scales_h, scales_l, on 2-byte boundaries), Q4_K/Q5_K
// (12, on 4-byte ones) or Q6_K (the 8 of a quad, on 8-byte ones), each word read by `read`: Ldg (or PrefetchL2) from
// the planes, a plain load from the ring's copy.
template <int CB, typename Read>
__device__ __forceinline__ SubScales sub_record(const unsigned char* p, Read read) {
    SubScales s{{0u, 0u, 0u, 0u}};
    if (CB == Q6_K) {
        const uint2 x = read(reinterpret_cast<const uint2*>(p));
        s.w[0] = x.x, s.w[1] = x.y;
    } else if (CB == IQ4_XS) {
        const u16* h = reinterpret_cast<const u16*>(p);
        s.w[0] = read(h), s.w[1] = (u32)read(h + 1) | ((u32)read(h + 2) << 16);
    } else {
        const u32* w = reinterpret_cast<const u32*>(p);
        s.w[0] = read(w), s.w[1] = read(w + 1), s.w[2] = read(w + 2);
    }
    return s;
}

// Where the sub-block scales of block j (of its super-block) lie in its column's record: Q6_K's quad's 8 of 16 bytes.
template <int CB>
__device__ __forceinline__ int sub_offset(int j) { return CB == Q6_K ? 8 * ((j >> 2) & 1) : 0; }

// Column `col` of super-block `sb` (at = sb * N + col): the sub-block scale bytes of block b0's span, each word by
// `read` (Ldg, PrefetchL2).
template <int CB, typename Read>
__device__ __forceinline__ SubScales load_sub(const unsigned char* __restrict__ sub, u64 at, int b0, Read read) {
    return sub_record<CB>(sub + at * Traits<CB>::SUB_BYTES + sub_offset<CB>(b0), read);
}

// Block j's derived scales (one per half) and min from the super-block's d, dmin and sub-block scales:
// d_w = d * sc (Q6_K: per half), m_w = dmin * m (Traits::MIN_SUBTRACTED), each an exact fp32 product (§2).
// UNPACKED: Q4_K/Q5_K's sub-block scales as SubScales::k6_unpacked holds them.
template <int CB, bool UNPACKED>
__device__ __forceinline__ void derive(float d, float dmin, const SubScales& s, int j,
                                       float (&d_w)[Traits<CB>::HALVES], float& m_w) {
    if (CB == Q6_K) {
        d_w[0] = mul_rn(d, int_to_float(s.q6(j, 0)));
        d_w[Traits<CB>::HALVES - 1] = mul_rn(d, int_to_float(s.q6(j, 1)));
    } else if (CB == IQ4_XS) {
        d_w[0] = mul_rn(d, int_to_float(s.xs(j)));
    } else {
        int sc, m;
        s.template k6<UNPACKED>(j, sc, m);
        d_w[0] = mul_rn(d, int_to_float(sc));
        m_w = mul_rn(dmin, int_to_float(m));
    }
}

// float(s) for |s| < 2^22 (a block dot product is at most 32*128*127 in magnitude), exactly and at full ALU
// rate, unlike I2F: an integer add places s in the mantissa of 1.5*2^23 (MAGIC), the subtraction is exact.
constexpr int MAGIC = 0x4B400000;
// The dp4a engine's nibbles in place (decode_word, decode_paired: IN_PLACE): a high nibble masked where it lies is
// 16 times its code, so its dot product, read unsigned (dp4a_us), is 16 s, a shift a word fewer than moving it down.
// A chain of such words ends at IN_PLACE_MAGIC + 16 s, which is 1.5*2^19 + s as a float (its mantissa step is 1/16;
// |s| < 2^18): Q4_K's block 1 of a pair, all high nibbles, starts its chain there; Q4_0/Q4_1, whose words 4..7 are
// a block's high nibbles, take the chain of words 0..3 to 16 times itself by one multiply-add (to_in_place). Q5_K's
// block 1 (block j of its super-block, j odd) at one row also keeps its fifth bits in place, bit j of each byte (2^j
// times the bit) as a second addend: their chain, times 2^(8-j), starts the nibbles' (16 * 16 per fifth bit), two
// masks and two dp4a a word where moving nibble and bit down took four instructions and one dp4a.
constexpr int IN_PLACE_MAGIC = 0x49400000;
__device__ __forceinline__ float magic_to_float(int magic_plus_s, bool in_place = false) {
    return sub_rn(__int_as_float(magic_plus_s), in_place ? 786432.0f : 12582912.0f);
}
__device__ __forceinline__ int to_in_place(int magic_plus_s) {
    return (int)((u32)magic_plus_s * 16u + ((u32)IN_PLACE_MAGIC - 16u * (u32)MAGIC));
}

// The sum of a block's activations 0..15 (its first 16 bytes, q_low): Q6_K's low half.
__device__ __forceinline__ int low_half_sum(int4 q_low) {
    return __dp4a(0x01010101, q_low.w, __dp4a(0x01010101, q_low.z, __dp4a(0x01010101, q_low.y,
                  __dp4a(0x01010101, q_low.x, 0))));
}

// What one activation row of one block contributes to every weight column's term.
template <int CB>
struct RowBlock {
    float d_a;
    float sum_a;  // float(Σq), asymmetric codebooks
    // MAGIC - OFFSET·Σq, the initial value of every integer dot product of the row's block (the dp4a chain's first
    // addend, the mma's C operand): bias + Σuq = MAGIC + Σ(u - OFFSET)q, exact, and no add per term.
    int bias;

    static __device__ __forceinline__ RowBlock of(float d_a, int s_a) {
        return RowBlock{d_a, magic_to_float(MAGIC + s_a), MAGIC - Traits<CB>::OFFSET * s_a};
    }

    // A staged block keeps beside d_a the one value of its activation sums that its codebook's terms use, made once per
    // CTA instead of once per block and column: the bits of float(s_a) (asymmetric codebooks), the bias (an offset),
    // Q6_K's two half sums (`low` of elements 0..15 in bits 0-15, the rest above: each at most 16 * 127 in magnitude),
    // else s_a; of_staged takes it back.
    static __device__ __forceinline__ int staged_word(int s_a, int4 q_low) {
        if (CB == Q6_K) {
            const int low = low_half_sum(q_low);
            return (low & 0xFFFF) | ((s_a - low) << 16);
        }
        const RowBlock r = of(0.0f, s_a);
        return Traits<CB>::ASYM ? __float_as_int(r.sum_a) : Traits<CB>::OFFSET ? r.bias : s_a;
    }
    static_assert(!Traits<CB>::ASYM || Traits<CB>::OFFSET == 0, "a staged word is float(s_a) or the bias, not both");
    static __device__ __forceinline__ RowBlock of_staged(float d_a, int word) {
        return RowBlock{d_a, Traits<CB>::ASYM ? __int_as_float(word) : 0.0f, Traits<CB>::OFFSET ? word : MAGIC};
    }

    // The block's term t (§1, §2) from the biased integer dot products bias + Σuq with a weight column, one per half
    // (in_place: IN_PLACE_MAGIC + 16 Σuq).
    __device__ __forceinline__ float term(const int (&biased)[Traits<CB>::HALVES],
                                          const float (&d_w)[Traits<CB>::HALVES], float m_w,
                                          bool in_place = false) const {
        float t = mul_rn(mul_rn(d_a, d_w[0]), magic_to_float(biased[0], in_place));
        if (Traits<CB>::HALVES == 2)
            t = add_rn(t, mul_rn(mul_rn(d_a, d_w[Traits<CB>::HALVES - 1]), magic_to_float(biased[Traits<CB>::HALVES - 1])));
        if (Traits<CB>::ASYM) {
            const float min_term = mul_rn(mul_rn(d_a, m_w), sum_a);
            t = Traits<CB>::MIN_SUBTRACTED ? sub_rn(t, min_term) : add_rn(t, min_term);
        }
        return t;
    }
};

// The planes of one weight matrix (docs/contract.md §2); planes a codebook lacks are null.
struct Planes {
    const u32* __restrict__ payload;     // [KB][N][WORDS]
    const u32* __restrict__ high;        // legacy Q5, Q5_K: [KB][N]; Q6_K: [KB][N][2]
    const u16* __restrict__ scale;       // fp16 d: [KB][N]; super-block formats [KB/8][N]
    const u16* __restrict__ minv;        // fp16 m: [KB][N]; K-quants dmin [KB/8][N]
    const unsigned char* __restrict__ sub;  // super-block formats: sub-block scales [KB/8][N][sc bytes]
};

// The parameters of every GEMV kernel, in the launchers' order (kernels.program.declared_signature reads them):
// the planes, the block-major activations (q, d_a, sum_a), M, N, KB, the partition width, the output y [M][N],
// and kpar's workspace (null for the one-CTA families): ticket_words(N) u32 ticket counters, one per CTA column,
// zero before the first launch (each launch leaves them zero), then the partials [S][M][N] fp32. The tickets sit
// first, at a size fixed by N, so candidates of any S and CTA width can share one workspace.
#define GEMV_PARAMS                                                                                        \
    const u32* __restrict__ payload, const u32* __restrict__ high, const u16* __restrict__ scale,          \
        const u16* __restrict__ minv, const unsigned char* __restrict__ sub, const int* __restrict__ qa,     \
        const float* __restrict__ da, const int* __restrict__ sa, int M, int N, int KB, int width,        \
        float* __restrict__ out, float* __restrict__ ws

// One ticket per 8 outputs bounds the CTA columns of every candidate; a multiple of 4 words keeps the partials
// 16-byte aligned.
__device__ __forceinline__ int ticket_words(int N) { return ((N + 7) / 8 + 3) / 4 * 4; }

// kpar's fold, in the kernel: every CTA has written its partition's partials of the columns
// [col_begin, col_begin + cols) to the workspace; the one that draws the last ticket of its column range (an
// integer counter: no float atomics) folds y = ((0 + acc_0) + acc_1) + ... in ascending p, the contract's order,
// and resets the counter for the next launch. The fold is the launch's serial tail, so it keeps loads in flight,
// but its registers are the kernel's and cost the main loop its occupancy (measured: lab/journal.md): each
// engine gives it a budget of FLOATS partials in flight per thread, loaded W adjacent columns at a time.
constexpr int FOLD_AHEAD_MAX = 8;  // partitions loaded before their adds
#ifndef GEMV_HOSTSIM
// Written by other SMs: read through L2, never L1.
template <int W>
__device__ __forceinline__ void load_l2(float (&v)[W], const float* p) {
    if constexpr (W == 4) {
        const float4 f = __ldcg(reinterpret_cast<const float4*>(p));
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else if constexpr (W == 2) {
        const float2 f = __ldcg(reinterpret_cast<const float2*>(p));
        v[0] = f.x, v[1] = f.y;
    } else {
        v[0] = __ldcg(p);
    }
}
// Thread 0 alone draws its CTA's ticket, after a barrier: the acq_rel atomic releases the whole CTA's partials
// (the barrier orders them before it, and a release is cumulative) and, for the last CTA, acquires the others'.
__device__ __forceinline__ unsigned draw_ticket(unsigned* ticket) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
    return old;
}
#else
template <int W>
inline void load_l2(float (&v)[W], const float* p) { for (int w = 0; w < W; ++w) v[w] = p[w]; }
inline unsigned draw_ticket(unsigned* ticket) { return atomicAdd(ticket, 1u); }
#endif

// Called by every thread of each of the S CTAs of a column range once its partials are written: true, in every
// thread, for the one CTA that drew the range's last ticket. The barrier's vote tells the threads (no shared
// memory: the ring uses it all).
__device__ __forceinline__ bool last_of_range(unsigned* ticket, int S) {
    __syncthreads();
    return __syncthreads_or(threadIdx.x + threadIdx.y == 0 && draw_ticket(ticket) == (unsigned)(S - 1));
}

template <int W, int FLOATS>
__device__ __forceinline__ void fold_columns(const float* __restrict__ partials, float* __restrict__ out, int S,
                                             int M, int N, int col_begin, int cols, int tid, int threads) {
    static_assert(FLOATS >= W, "a fold budget holds at least one load of W columns");
    constexpr int AHEAD = FLOATS / W < FOLD_AHEAD_MAX ? FLOATS / W : FOLD_AHEAD_MAX;
    const int groups = cols / W;
    const u64 plane = (u64)M * N;
    for (int i = tid; i < M * groups; i += threads) {
        const int c = col_begin + i % groups * W;
        if (c >= N) continue;  // W divides N, so c + W - 1 < N too
        const u64 at = (u64)(i / groups) * N + c;
        float y[W];
#pragma unroll
        for (int w = 0; w < W; ++w) y[w] = 0.0f;
        for (int q0 = 0; q0 < S; q0 += AHEAD) {
            float v[AHEAD][W];
#pragma unroll
            for (int j = 0; j < AHEAD; ++j)
                if (q0 + j < S) load_l2<W>(v[j], partials + (q0 + j) * plane + at);
#pragma unroll
            for (int j = 0; j < AHEAD; ++j)
                if (q0 + j < S)
#pragma unroll
                    for (int w = 0; w < W; ++w) y[w] = add_rn(y[w], v[j][w]);
        }
#pragma unroll
        for (int w = 0; w < W; ++w) out[at + w] = y[w];
    }
}

// The fold of the last CTA: W = 4, 2 or 1 adjacent columns per load, the widest that divides N and still gives
// every thread a group; FLOATS / W partitions ahead (at most FOLD_AHEAD_MAX). cols and col_begin are multiples
// of 4 (every candidate's CTA covers 32 or more columns).
template <int FLOATS>
__device__ __forceinline__ void fold_last(float* __restrict__ ws, float* __restrict__ out, int S, int M, int N,
                                          int col_begin, int cols) {
    unsigned* tickets = reinterpret_cast<unsigned*>(ws);
    if (!last_of_range(tickets + blockIdx.x, S)) return;
    const float* partials = ws + ticket_words(N);
    const int tid = threadIdx.x + blockDim.x * threadIdx.y, threads = blockDim.x * blockDim.y;
    if (N % 4 == 0 && M * cols >= 4 * threads)
        fold_columns<4, FLOATS>(partials, out, S, M, N, col_begin, cols, tid, threads);
    else if (N % 2 == 0 && M * cols >= 2 * threads)
        fold_columns<2, FLOATS>(partials, out, S, M, N, col_begin, cols, tid, threads);
    else
        fold_columns<1, FLOATS>(partials, out, S, M, N, col_begin, cols, tid, threads);
    if (tid == 0) tickets[blockIdx.x] = 0u;  // every CTA of the range has drawn its ticket
}
// Fold budgets per engine (floats in flight per folding thread): the dp4a engine holds its main loop's loads in
// registers, the ring holds its in shared memory.
constexpr int FOLD_FLOATS_DP4A = 8, FOLD_FLOATS_RING = 32;

// One column's weights for one group of G blocks (dp4a engine): the group's payload rows, its high bits, and the
// scales of its blocks (legacy: read from the planes; super-block formats: derived per block). G is the format's
// GROUP (the blocks that share payload rows), or 8 where a thread walks a super-block at a time (the formats whose
// sub-block scales a column holds whole: SPAN 8).
template <int CB, int G>
struct ColumnGroup {
    typedef Traits<CB> T;
    static_assert(G == T::GROUP || (T::SPAN == 8 && G == 8), "a group shares rows, or is a super-block (not Q6_K's)");
    static constexpr int QH = CB == Q5_K ? 8 : (CB == Q6_K ? 8 : 1);  // Q5_K: the super-block's; Q6_K: the quad's
    u32 w[G][T::WORDS];
    u32 qh[QH];
    float d, dmin;  // legacy: the block's scale and min; super-block formats: the super-block's
    SubScales sub;

    // Group `grp` (blocks grp*G ...) of column `col`. Super-block fields are reloaded only when `fresh` (a new
    // SPAN of blocks). A super-block group's rows outside [r_begin, r_end), the rows of the partition's blocks
    // (their pairs or quads whole), load one inside it again (an L1 hit), so a partition that cuts a super-block
    // reads no other partition's bytes.
    // EDGE = false: the caller knows the group's rows lie inside [r_begin, r_end). Each value is read by `read` (Ldg;
    // PrefetchL2 asks for the group's lines and holds nothing).
    template <bool EDGE = true, typename Read = Ldg>
    __device__ __forceinline__ void load(const Planes& P, int grp, int col, int N, bool fresh, int r_begin, int r_end,
                                         Read read = Read()) {
        const int b0 = grp * G;
#pragma unroll
        for (int i = 0; i < G; ++i) {
            const int b = G > T::GROUP && EDGE ? min(max(b0 + i, r_begin), r_end - 1) : b0 + i;
            const u64 at = (u64)b * N + col;
#pragma unroll
            for (int v = 0; v < T::WORDS / 4; ++v) {
                const uint4 x = read(reinterpret_cast<const uint4*>(P.payload + at * T::WORDS) + v);
                w[i][4 * v] = x.x, w[i][4 * v + 1] = x.y, w[i][4 * v + 2] = x.z, w[i][4 * v + 3] = x.w;
            }
            if (CB == Q6_K) {
                const uint2 h = read(reinterpret_cast<const uint2*>(P.high) + at);
                qh[2 * i] = h.x, qh[2 * i + 1] = h.y;
            }
        }
        if (!T::SUPER) {
            const u64 at = (u64)b0 * N + col;
            qh[0] = T::HIGH ? read(P.high + at) : 0u;
            d = half_bits_to_float(read(P.scale + at));
            dmin = T::ASYM ? half_bits_to_float(read(P.minv + at)) : 0.0f;
        } else if (fresh) {
            const int sb = b0 >> 3;
            const u64 at = (u64)sb * N + col;
            d = half_bits_to_float(read(P.scale + at));
            dmin = T::ASYM ? half_bits_to_float(read(P.minv + at)) : 0.0f;
            sub = load_sub<CB>(P.sub, at, b0, read);
            if (CB == Q4_K || CB == Q5_K) sub = sub.k6_unpacked();
            if (CB == Q5_K)
#pragma unroll
                for (int i = 0; i < 8; ++i) qh[i] = read(P.high + (u64)(8 * sb + i) * N + col);
        }
    }

    // Super-block formats: take the fields a group carries from the first group of its SPAN.
    __device__ __forceinline__ void share(const ColumnGroup& first) {
        d = first.d, dmin = first.dmin, sub = first.sub;
        if (CB == Q5_K)
#pragma unroll
            for (int i = 0; i < QH; ++i) qh[i] = first.qh[i];
    }

    // Block u of the group (block b of the matrix): int8 words v[0][k] = elements 4k..4k+3, its scales and min;
    // SELECTOR_ORDER (lookup codebooks): v[0] and v[1] the two addends of iq4nl_addends in iq4nl_pairs' order, for
    // activations staged in it (to_selector_order). IN_PLACE: nibbles in place (IN_PLACE_MAGIC); with two addends,
    // Q5_K's odd block holds its fifth bits in place in v[1].
    template <bool SELECTOR_ORDER, bool RAW6, bool IN_PLACE, int ADDENDS>
    __device__ __forceinline__ void block(int u, int b, int (&v)[ADDENDS][8], float (&d_w)[T::HALVES],
                                          float& m_w) const {
        static_assert(!SELECTOR_ORDER || T::TABLE, "the selector order is the lookup's");
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if constexpr (SELECTOR_ORDER) {
                u32 low[2], high[2];
                iq4nl_addends(w[u][k], low, high);
                v[0][2 * k] = (int)low[0], v[0][2 * k + 1] = (int)low[1];
                v[1][2 * k] = (int)high[0], v[1][2 * k + 1] = (int)high[1];
            } else if constexpr (T::GROUP == 1) {
                decode_word<CB, IN_PLACE>(w[u][k], w[u][CB == Q8_0 ? k + 4 : k], qh[0], k, v[0][k], v[0][k + 4]);
            } else if constexpr (CB == Q6_K) {
                const int r = 2 * (u & 1);
                decode_paired<CB, RAW6>(w[r][k], w[r + 1][k], q6k_high(qh[k], u), q6k_high(qh[4 + k], u), u, v[0][k],
                                        v[0][k + 4]);
            } else {
                const bool bits_apart = CB == Q5_K && ADDENDS == 2 && (u & 1);
                const u32 h0 = CB == Q5_K && !bits_apart ? q5k_high(qh[k], b & 7) : 0u;
                const u32 h1 = CB == Q5_K && !bits_apart ? q5k_high(qh[4 + k], b & 7) : 0u;
                decode_paired<CB, false, IN_PLACE>(w[u & ~1][k], w[u | 1][k], h0, h1, u & 1, v[0][k], v[0][k + 4]);
                if (bits_apart) {
                    const u32 bit = 0x01010101u << (b & 7);
                    v[ADDENDS - 1][k] = (int)(qh[k] & bit), v[ADDENDS - 1][k + 4] = (int)(qh[4 + k] & bit);
                }
            }
        }
        if (T::SUPER) {
            derive<CB, true>(d, dmin, sub, b & 7, d_w, m_w);
        } else {
            d_w[0] = d, m_w = dmin;
        }
    }
};

// The integer chains of a decoded block (v: ColumnGroup::block's words, block u of its group, block j of its
// super-block) with one activation row's words xq: s[h] = bias[h] + Σuq of each half, or where the chains end in
// place (the return value) IN_PLACE_MAGIC + 16 Σuq. u and j are compile-time facts once the caller's loop is unrolled.
template <int CB, bool IN_PLACE, bool SELECTOR_ORDER, int ADDENDS>
__device__ __forceinline__ bool block_chains(const int (&v)[ADDENDS][8], const int (&xq)[8],
                                             const int (&bias)[Traits<CB>::HALVES], int u, int j,
                                             int (&s)[Traits<CB>::HALVES]) {
    if (IN_PLACE && Traits<CB>::GROUP == 2 && (u & 1)) {  // Q4_K/Q5_K's block 1 of a pair: every word in place
        s[0] = IN_PLACE_MAGIC;  // the K-quants have no offset
        if (ADDENDS == 2) {  // Q5_K: the chain of its fifth bits (2^j times each) first, times 2^(8-j)
            int bits = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) bits = dp4a_us(v[ADDENDS - 1][k], xq[k], bits);
            s[0] = (int)((u32)bits * (256u >> j) + (u32)IN_PLACE_MAGIC);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) s[0] = dp4a_us(v[0][k], xq[k], s[0]);
        return true;
    }
    if (IN_PLACE && Traits<CB>::GROUP == 1) {  // Q4_0/Q4_1: words 4..7 in place, the chain of words 0..3 moved there
        s[0] = bias[0];
#pragma unroll
        for (int k = 0; k < 4; ++k) s[0] = __dp4a(v[0][k], xq[k], s[0]);
        s[0] = to_in_place(s[0]);
#pragma unroll
        for (int k = 4; k < 8; ++k) s[0] = dp4a_us(v[0][k], xq[k], s[0]);
        return true;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int h = k < 4 ? 0 : Traits<CB>::HALVES - 1;  // Q6_K: the high half apart
        s[h] = __dp4a(v[0][k], xq[k], k == 0 || (k == 4 && h == 1) ? bias[h] : s[h]);
#pragma unroll
        for (int a = 1; a <= SELECTOR_ORDER; ++a) s[h] = __dp4a(v[a][k], xq[k], s[h]);  // the lookup's second addend
    }
    return false;
}

// One activation row of one block (block-major: at = b * M + m): its 32 int8 values, d_a and the integer sum.
struct ActivationRow {
    int4 q0, q1;
    float d_a;
    int s_a;

    static __device__ __forceinline__ ActivationRow load(const int* __restrict__ qa, const float* __restrict__ da,
                                                         const int* __restrict__ sa, u64 at) {
        return ActivationRow{__ldg(reinterpret_cast<const int4*>(qa) + 2 * at),
                             __ldg(reinterpret_cast<const int4*>(qa) + 2 * at + 1), __ldg(da + at), __ldg(sa + at)};
    }

    // Staged block j of a CTA (gemv_staged): rows q[2j], q[2j+1], then {d_a bits, RowBlock::staged_word} at ds[j]
    // (in s_a).
    static __device__ __forceinline__ ActivationRow staged(const int4* q, const int2* ds, int j) {
        return ActivationRow{q[2 * j], q[2 * j + 1], __int_as_float(ds[j].x), ds[j].y};
    }
};

// A block of one activation row staged in shared memory (gemv_staged): its 32 int8 values, then {d_a bits,
// RowBlock::staged_word} in an array behind the rows (kernels.registry.STAGED_BLOCK_BYTES).
constexpr int STAGED_BLOCK_BYTES = 40;
static_assert(STAGED_BLOCK_BYTES == 2 * sizeof(int4) + sizeof(int2), "a staged block is its row and {d_a, s_a}");

template <bool B>
struct Flag {  // a compile-time bool as a value (a generic lambda's argument)
    static constexpr bool value = B;
};

// The dp4a engine's body. STAGE (M = 1, gemv_staged): the CTA first copies the activation blocks its threads walk
// (direct and wide: all KB; kpar: its partition) into shared memory behind the direct family's partials, and the
// threads read a block's row there at use instead of loading it with the weights: the registers that held the rows
// in flight go to more CTAs per SM.
template <int CB, int CPT, int MT, bool GRID_SPLIT, bool STAGE>
__device__ __forceinline__ void dp4a_partial(GEMV_PARAMS) {
    static_assert(!STAGE || MT == 1, "a staged launch computes one row");
    typedef Traits<CB> T;
    // The staged launches of IQ4_XS, Q4_K and Q5_K walk a super-block per group: its payload, d (dmin), sub-block
    // scales (and Q5_K's qh words) loaded together, each block's scale and high bit at a constant place. Smaller
    // groups load the fields behind a branch per group, find a block's scale by variable shifts and (batched) copy
    // the fields from slot to slot. Unstaged, one row's activations ride along with each block (ROW_AHEAD), or
    // several rows' are loaded at use (a super-block walk took IQ4_XS's from 60-99 registers to 87-124).
    constexpr bool SUPER_WALK = T::SUPER && T::SPAN == 8 && STAGE;
    constexpr int G = SUPER_WALK ? 8 : T::GROUP, H = T::HALVES;
    // Columns a thread decodes at once: Traits::COLUMNS, one for a super-block walk (32 payload words a column).
    constexpr int CC = SUPER_WALK ? 1 : T::COLUMNS < CPT ? T::COLUMNS : CPT;
    // Loads of several blocks in flight; fewer when the tile already holds many registers. A group of the
    // paired formats already loads 2 (Q6_K: 4, a super-block walk 8) blocks.
    constexpr int UNROLL = G >= 4 ? 1 : (MT * CC <= 2 ? 4 / G : (MT * CC <= 4 ? 2 / G : 1));
    // The loads of a batch of UNROLL groups are issued before the first is used (a compiler-unrolled loop branched
    // before each group's loads: one DRAM round trip per group). Q5_K batches only where a thread walks one column
    // at a time (with two, their 8 qh words each spill); IQ4_XS's groups of one block not at all (their batch
    // measured 1.16-1.49x slower at M = 1).
    constexpr int BATCH = (CB == Q5_K && CC > 1) || (CB == IQ4_XS && G == 1) ? 1 : UNROLL;
    constexpr bool ROW_AHEAD = MT == 1 && G == 1 && !STAGE;  // one row, one block per group: its activations ride along
    constexpr bool SELECTOR_ORDER = STAGE && T::TABLE;       // staged in the lookup's order (to_selector_order)
    // Q6_K's 6-bit codes uncentred (centre6) where a block's decode serves at most two rows: the half sums each row
    // then needs cost less than the centring they spare.
    constexpr bool RAW6 = CB == Q6_K && MT <= 2;
    // High nibbles in place (IN_PLACE_MAGIC): Q4_K's odd blocks always; Q5_K's at one row (a row then takes a second
    // chain and a multiply-add, the block's decode two instructions a word fewer); Q4_0/Q4_1's where a block's decode
    // serves at most two rows (a row's chain then takes a multiply-add, the block's decode four shifts fewer).
    constexpr bool IN_PLACE = CB == Q4_K || (CB == Q5_K && MT == 1) || ((CB == Q4_0 || CB == Q4_1) && MT <= 2);
    constexpr int ADDENDS = SELECTOR_ORDER || (CB == Q5_K && IN_PLACE) ? 2 : 1;  // v's words per payload word
    // The staged walks' ring: each batch's bytes reach shared memory by cp.async while the thread computes the batch
    // before (CopyTo, CopiedFrom), where a load of its own would wait a DRAM round trip per batch. Where the launch
    // gives shared memory past the staged blocks (kernels.registry.Candidate.shared_bytes: PIPE_SLOTS slots per
    // thread, where they fit and the thread's walk is long) and N is even; else the walk loads as the others do. Not
    // Q8_0's: its copies cost more than they hide (registry.PIPE_GROUP_BYTES has no Q8_0 slot). A slot holds a batch:
    // BATCH groups of CC columns (a super-block, Q6_K a quad, else a block, each of one column or two).
    constexpr bool PIPE = STAGE && CB != Q8_0;
    constexpr int PIPE_SLOTS = 2;
    // A group's 16-byte cells: its payload rows (Q6_K: and their high words, and the quad's scales); 4-byte cells: d,
    // dmin, the sub-block scales' reads, Q5_K's qh words, a legacy block's high bits.
    constexpr int PIPE_WIDE = BATCH * CC * (G * T::WORDS / 4 + (CB == Q6_K ? G + 1 : 0));
    constexpr int PIPE_NARROW =
        BATCH * CC * (1 + T::ASYM + (T::SUPER ? (CB == Q6_K ? 0 : 3) + (CB == Q5_K ? 8 : 0) : T::HIGH));
    DYNAMIC_SHARED(float, partials);  // direct family: [S-1][MT][blockDim.x*CPT], then (STAGE) the staged blocks
    const Planes P{payload, high, scale, minv, sub};

    const int S = GRID_SPLIT ? gridDim.y : blockDim.y;
    const int p = GRID_SPLIT ? blockIdx.y : threadIdx.y;
    const int col0 = (blockIdx.x * blockDim.x + threadIdx.x) * CPT;
    const bool live = col0 < N;  // the registry guarantees N % CPT == 0
    const int b_begin = p * width;
    const int b_end = min(KB, b_begin + width);
    const int g_begin = b_begin / G, g_end = (b_end + G - 1) / G;
    // The payload rows of the partition's blocks: whole pairs (quads) of the paired formats.
    const int r_begin = b_begin / T::GROUP * T::GROUP, r_end = (b_end + T::GROUP - 1) / T::GROUP * T::GROUP;
    // A group whose super-block fields are (re)loaded: the partition's first, and the first of each SPAN.
    auto starts_span = [&](int grp) { return grp == g_begin || (grp * G) % T::SPAN == 0; };
    const int stage_begin = GRID_SPLIT ? b_begin : 0, staged = (GRID_SPLIT ? b_end : KB) - stage_begin;
    // Every CTA lays out the room Candidate.shared_bytes gives it (kpar: a whole partition's blocks), not the blocks
    // it stages: past a short last partition's blocks lies the room of those it lacks, not the ring.
    const int stage_room = GRID_SPLIT ? width : KB;
    int4* stage_q = reinterpret_cast<int4*>(partials + (GRID_SPLIT ? 0 : (S - 1) * MT * blockDim.x * CPT));
    int2* stage_ds = reinterpret_cast<int2*>(stage_q + 2 * stage_room);
    const int tid = threadIdx.x + blockDim.x * threadIdx.y, threads = blockDim.x * blockDim.y;
    unsigned char* const ring = reinterpret_cast<unsigned char*>(partials) +
        ((reinterpret_cast<unsigned char*>(stage_ds + stage_room) - reinterpret_cast<unsigned char*>(partials) + 15) &
         ~15);
    const bool pipe = PIPE && N % 2 == 0 && (u32)(ring - reinterpret_cast<unsigned char*>(partials)) < dynamic_shared_bytes();
    auto ring_slot = [&](int k) {
        unsigned char* const wide = ring + 16 * threads * PIPE_WIDE * k;
        return RingSlot{wide + 16 * tid, ring + 16 * threads * PIPE_WIDE * PIPE_SLOTS + 4 * threads * PIPE_NARROW * k +
                        4 * tid, 16u * threads, 4u * threads};
    };

    // Group i of column c of the batch g0... of columns column0..., as `batch` loads it (past the end: the last group
    // again), loaded into to(i, c) through `read` (CopyTo, CopiedFrom: the same cells, in the same order).
    auto ring_batch = [&](int g0, int column0, auto to, auto read) {
#pragma unroll
        for (int i = 0; i < BATCH; ++i)
#pragma unroll
            for (int c = 0; c < CC; ++c) {
                const int grp = min(g0 + i, g_end - 1);
                to(i, c).template load<true>(P, grp, column0 + c, N, starts_span(grp), r_begin, r_end, read);
            }
    };
    // The batch g0... into ring slot k (past the partition: nothing), then a commit: the ring waits for all but its
    // newest commit.
    auto copy_batch = [&](int g0, int column0, int k) {
        if (g0 < g_end) {
            int cells[2] = {0, 0};
            ColumnGroup<CB, G> copied[BATCH][CC];  // holds nothing: CopyTo reads zeros
            ring_batch(g0, column0, [&](int i, int c) -> ColumnGroup<CB, G>& { return copied[i][c]; },
                       CopyTo(ring_slot(k), cells));
        }
        cp_async_commit();
    };
    if (PIPE && pipe && live) copy_batch(g_begin, col0, 0);  // in flight while the CTA stages its activations
    // Staged, without the ring: the thread's first batch of weights heads for L2 while the CTA stages its activations,
    // so the launch's first DRAM round trip overlaps the staging's instead of following its barrier. A walk of one or
    // two batches skips it: there the prefetches would be a third to a half of the thread's memory instructions.
    if (STAGE && live && !pipe && g_end - g_begin > 2 * BATCH)
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int grp = min(g_begin + i, g_end - 1);  // as the first batch clamps it
#pragma unroll
            for (int c = 0; c < CC; ++c)
                ColumnGroup<CB, G>().load(P, grp, col0 + c, N, starts_span(grp), r_begin, r_end, PrefetchL2());
        }
    for (int m0 = 0; m0 < M; m0 += MT) {
        const int rows = min(MT, M - m0);
        if (STAGE) {
            if (m0 > 0) __syncthreads();  // every thread has read the previous row
            // A thread loads a block's row, d_a and s_a together, one L2 round trip for each of its blocks, where a pass
            // over the rows' 16-byte halves and another over the sums took three. (One block at a time: more in
            // flight did not pay, lab/journal.md.)
            for (int i = tid; i < staged; i += threads) {
                const u64 at = (u64)(stage_begin + i) * M + m0;
                const int4* q = reinterpret_cast<const int4*>(qa) + 2 * at;
                int4 q0 = __ldg(q), q1 = __ldg(q + 1);
                stage_ds[i] = make_int2(__float_as_int(__ldg(da + at)), RowBlock<CB>::staged_word(__ldg(sa + at), q0));
                if constexpr (SELECTOR_ORDER) to_selector_order(q0, q1);
                stage_q[2 * i] = q0, stage_q[2 * i + 1] = q1;
            }
            __syncthreads();
        }
        float acc[MT][CPT];
#pragma unroll
        for (int r = 0; r < MT; ++r)
#pragma unroll
            for (int c = 0; c < CPT; ++c) acc[r][c] = 0.0f;

        if (live) {
#pragma unroll
          for (int c0 = 0; c0 < CPT; c0 += CC) {  // columns [c0, c0 + CC) walk K together
            // The loads of a batch of BATCH groups are issued before any is used. Super-block fields are loaded
            // only into the slot of a SPAN's first group (`fresh`): with one slot they stay in place, with several
            // `carry` takes them at use and hands them to the slots that follow.
            ColumnGroup<CB, G> col[BATCH][CC];
            ColumnGroup<CB, G> carry[T::SUPER && BATCH > 1 ? CC : 1];
            ActivationRow act[ROW_AHEAD ? BATCH : 1];
            // The batch of groups g0...; EDGE: the batch may reach past the partition (its groups past the end load
            // the last again and are skipped, a group's rows are clamped and its blocks checked), else it lies inside
            // it (no clamp, no check: the interior of a one-row walk).
            // The blocks of the batch's groups once `col` holds them.
            auto compute = [&](const int g0, auto edge) {
                constexpr bool EDGE = decltype(edge)::value;
#pragma unroll
                for (int i = 0; i < BATCH; ++i) {
                    const int grp = g0 + i;
                    if (BATCH > 1 && EDGE && grp >= g_end) break;  // uniform
                    if (T::SUPER && BATCH > 1)
#pragma unroll
                        for (int c = 0; c < CC; ++c)
                            starts_span(grp) ? carry[c].share(col[i][c]) : col[i][c].share(carry[c]);
#pragma unroll
                    for (int u = 0; u < G; ++u) {
                        const int b = grp * G + u;
                        if (G > 1 && EDGE && (b < b_begin || b >= b_end)) continue;  // uniform: the group's edge
                        // Decode each weight block once per row tile.
                        int v[CC][ADDENDS][8];
                        float dw[CC][H], mw[CC];
#pragma unroll
                        for (int c = 0; c < CC; ++c)
                            col[i][c].template block<SELECTOR_ORDER, RAW6, IN_PLACE>(u, b, v[c], dw[c], mw[c]);
#pragma unroll
                        for (int r = 0; r < MT; ++r) {
                            if (r < rows) {
                                const ActivationRow x = ROW_AHEAD ? act[i]
                                                      : STAGE ? ActivationRow::staged(stage_q, stage_ds, b - stage_begin)
                                                              : ActivationRow::load(qa, da, sa, (u64)b * M + m0 + r);
                                const RowBlock<CB> row = STAGE ? RowBlock<CB>::of_staged(x.d_a, x.s_a)
                                                               : RowBlock<CB>::of(x.d_a, x.s_a);
                                const int xq[8] = {x.q0.x, x.q0.y, x.q0.z, x.q0.w, x.q1.x, x.q1.y, x.q1.z, x.q1.w};
                                int bias[H];  // each half's chain start; RAW6: MAGIC - 32 * the half's activation sum
                                if constexpr (RAW6) {
                                    int low, high;
                                    if constexpr (STAGE) {  // the staged half sums (RowBlock::staged_word)
                                        low = (x.s_a << 16) >> 16, high = x.s_a >> 16;
                                    } else {
                                        low = low_half_sum(x.q0), high = x.s_a - low;
                                    }
                                    bias[0] = MAGIC - Q6_K_OFFSET * low, bias[H - 1] = MAGIC - Q6_K_OFFSET * high;
                                } else {
#pragma unroll
                                    for (int h = 0; h < H; ++h) bias[h] = row.bias;
                                }
#pragma unroll
                                for (int c = 0; c < CC; ++c) {
                                    int s[H];
                                    const bool in_place =
                                        block_chains<CB, IN_PLACE, SELECTOR_ORDER>(v[c], xq, bias, u, b & 7, s);
                                    acc[r][c0 + c] = add_rn(acc[r][c0 + c], row.term(s, dw[c], mw[c], in_place));
                                }
                            }
                        }
                    }
                }
            };
            auto batch = [&](const int g0, auto edge) {
                constexpr bool EDGE = decltype(edge)::value;
#pragma unroll
                for (int i = 0; i < BATCH; ++i) {
                    const int grp = EDGE ? min(g0 + i, g_end - 1) : g0 + i;  // past the end: the last again (an L1 hit)
#pragma unroll
                    for (int c = 0; c < CC; ++c)
                        col[i][c].template load<EDGE>(P, grp, col0 + c0 + c, N, starts_span(grp), r_begin, r_end);
                    if (ROW_AHEAD) act[i] = ActivationRow::load(qa, da, sa, (u64)grp * M + m0);
                }
                compute(g0, edge);
            };
            if (PIPE && pipe) {  // batch g0 + BATCH copied while g0 is computed
                if (c0 > 0) copy_batch(g_begin, col0 + c0, 0);
                for (int g0 = g_begin, k = 0; g0 < g_end; g0 += BATCH, k ^= 1) {
                    copy_batch(g0 + BATCH, col0 + c0, k ^ 1);
                    cp_async_wait<1>();  // all but the newest: batch g0's copies have landed
                    int cells[2] = {0, 0};
                    ring_batch(g0, col0 + c0, [&](int i, int c) -> ColumnGroup<CB, G>& { return col[i][c]; },
                               CopiedFrom{ring_slot(k), cells});
                    compute(g0, Flag<true>());
                }
                continue;
            }
            // One row, several blocks a group or batched groups (at two rows, the interior's copy of the body took
            // Q4_K's kernels from 69-85 registers to 89-104; at eight it spilled Q5_K's): in ascending order a partial
            // first group's batch (several blocks a group), the whole batches, the rest. Not IQ4_XS's super-block walk:
            // its staged launches ran 1.2-1.3x slower in three loops.
            if constexpr (MT == 1 && (G > 1 || BATCH > 1) && !(CB == IQ4_XS && SUPER_WALK)) {
                const int inner_begin = (b_begin + G - 1) / G, inner_end = b_end / G;  // the groups inside
                int g0 = g_begin;
                for (; g0 < inner_begin; g0 += BATCH) batch(g0, Flag<true>());  // once at most
                for (; g0 + BATCH <= inner_end; g0 += BATCH) batch(g0, Flag<false>());
                for (; g0 < g_end; g0 += BATCH) batch(g0, Flag<true>());
            } else {
#pragma unroll(BATCH == 1 ? UNROLL : 1)
                for (int g0 = g_begin; g0 < g_end; g0 += BATCH) batch(g0, Flag<true>());
            }
          }
        }

        if (GRID_SPLIT) {
            if (live)
#pragma unroll
                for (int r = 0; r < MT; ++r)
                    if (r < rows)
#pragma unroll
                        for (int c = 0; c < CPT; ++c)
                            ws[ticket_words(N) + ((u64)p * M + m0 + r) * N + col0 + c] = acc[r][c];
        } else {
            const int stride = blockDim.x * CPT;
            const int lcol = threadIdx.x * CPT;
            if (p > 0)
#pragma unroll
                for (int r = 0; r < MT; ++r)
#pragma unroll
                    for (int c = 0; c < CPT; ++c) partials[((p - 1) * MT + r) * stride + lcol + c] = acc[r][c];
            if (S > 1) __syncthreads();
            if (p == 0 && live) {
#pragma unroll
                for (int r = 0; r < MT; ++r) {
                    if (r < rows) {
#pragma unroll
                        for (int c = 0; c < CPT; ++c) {
                            float y = add_rn(0.0f, acc[r][c]);
                            for (int q = 1; q < S; ++q) y = add_rn(y, partials[((q - 1) * MT + r) * stride + lcol + c]);
                            out[(u64)(m0 + r) * N + col0 + c] = y;
                        }
                    }
                }
            }
            if (S > 1) __syncthreads();  // the partials are reused by the next row tile
        }
    }
    if constexpr (GRID_SPLIT)
        fold_last<FOLD_FLOATS_DP4A>(ws, out, S, M, N, blockIdx.x * blockDim.x * CPT, blockDim.x * CPT);
}

// 512 threads at most (direct: threads x S <= 512) caps registers at 128 so every launch fits an SM.
template <int CB, int CPT, int MT, bool GRID_SPLIT>
__global__ void gemv_partial(GEMV_PARAMS) {
    dp4a_partial<CB, CPT, MT, GRID_SPLIT, false>(payload, high, scale, minv, sub, qa, da, sa, M, N, KB, width, out, ws);
}

// The staged twin at M = 1 (kernels.registry: a candidate's `staged`), with the dynamic shared memory of
// Candidate.shared_bytes.
template <int CB, int CPT, bool GRID_SPLIT>
__global__ void gemv_staged(GEMV_PARAMS) {
    dp4a_partial<CB, CPT, 1, GRID_SPLIT, true>(payload, high, scale, minv, sub, qa, da, sa, M, N, KB, width, out, ws);
}

// Tensor-core engine, a launch choice of wide (S = 1) and kpar (GRID_SPLIT): mma.sync m16n8k32 s8 yields a
// block's dot products exactly in int32, so the bytes equal the dp4a engine's. A = activations (16 rows of
// an M tile, rows past M are zero), B = weights (8 outputs), C[row][output]. GGUF's nibble order fits the
// fragments: lane (g, t) needs elements 4t..4t+3 and 16+4t..16+4t+3 of a block, which are the two nibble
// halves of payload word t, and its C rows g, g+8 are the A rows whose d_a and sum_a it loads. A Q6_K block
// takes two mmas, one per 16-element half (the other half's B register zero), for its two scales.
// C starts at the bias of each C value's row, so the results are biased dot products. At M <= 8 the ring swaps
// the operands (A = weights of 16 outputs, B = activations of 8 rows: ring_chunk_weights_a), so no lane computes an
// empty row half.
#ifndef GEMV_HOSTSIM
__device__ __forceinline__ void mma_s8(const int (&a)[4], int b0, int b1, const int (&c_in)[4], int (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c_in[0]), "r"(c_in[1]), "r"(c_in[2]),
          "r"(c_in[3]));
}
#else
inline void mma_s8(const int (&a)[4], int b0, int b1, const int (&c_in)[4], int (&c)[4]) {
    hostsim::mma_m16n8k32_s8(a, b0, b1, c_in, c);
}
#endif

// A block's integer dot products into C from c_in: one mma, or for Q6_K, whose halves have a scale each, one per half
// (the other half's k columns zero in B).
template <int H>
__device__ __forceinline__ void mma_block(const int (&a)[4], int b0, int b1, const int (&c_in)[4], int (&c)[H][4]) {
    if constexpr (H == 2) {
        mma_s8(a, b0, 0, c_in, c[0]);
        mma_s8(a, 0, b1, c_in, c[1]);
    } else {
        mma_s8(a, b0, b1, c_in, c[0]);
    }
}

// One block's contribution to one 8-output tile of a warp, the activations as A: the mma of each M tile with the
// tile's decoded B words `b[0]` (elements 4t.., 16+4t..; the lookup codebooks: X = 2 addends in selector order, an mma
// each, its A fragments in that order too), from the rows' biases (no add per term), then the terms of the lane's C
// values in the contract's order. `a`, `rows`: the A fragments and row data of the lane's C rows g and g+8 of each M
// tile; `left` rows of the pass lie below M (8-row halves past them are skipped: warp-uniform), a compile-time
// constant in the ring's whole chunks, so a block's instructions carry no branch and interleave with the next block's.
template <int CB, int MTILES, int X>
__device__ __forceinline__ void mma_tile(const int (&a)[MTILES][4], const RowBlock<CB> (&rows)[MTILES][2],
                                         const int (&b)[X][2], const float (&d_w)[2][Traits<CB>::HALVES],
                                         const float (&m_w)[2], int left, float (&acc)[MTILES][4]) {
    constexpr int H = Traits<CB>::HALVES;
    static_assert(H == 1 || X == 1, "a Q6_K block's halves take one B word each");
#pragma unroll
    for (int i = 0; i < MTILES; ++i) {
        if (16 * i >= left) break;
        int c[H][4];
        const int c_in[4] = {rows[i][0].bias, rows[i][0].bias, rows[i][1].bias, rows[i][1].bias};  // C rows g, g+8
        mma_block<H>(a[i], b[0][0], b[0][1], c_in, c);
#pragma unroll
        for (int x = 1; x < X; ++x) mma_s8(a[i], b[x][0], b[x][1], c[0], c[0]);  // the lookup's second addend
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 1 && 16 * i + 8 >= left) break;  // no rows g+8
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int biased[H];
#pragma unroll
                for (int q = 0; q < H; ++q) biased[q] = c[q][2 * h + e];
                acc[i][2 * h + e] = add_rn(acc[i][2 * h + e], rows[i][h].term(biased, d_w[e], m_w[e]));
            }
        }
    }
}

// The warp's results for one M pass: C columns 2t, 2t+1 of rows g, g+8 of each tile, outputs from `n_first`; kpar
// writes its partition's partials, wide the fold's 0 + acc (which turns -0 into +0, as S = 1 of §1 does).
template <int NT, int MTILES, bool GRID_SPLIT>
__device__ __forceinline__ void mma_store(const float (&acc)[NT][MTILES][4], float* __restrict__ out, int p, int m0,
                                          int M, int N, int n_first, int tiles, int g, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < MTILES; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + 16 * i + 8 * h + g;
                if (j >= tiles || r >= M) continue;
                const u64 at = (GRID_SPLIT ? ((u64)p * M + r) : (u64)r) * N + n_first + 8 * j + 2 * t;
                const float* y = acc[j][i] + 2 * h;
                if (GRID_SPLIT)
                    *reinterpret_cast<float2*>(out + at) = make_float2(y[0], y[1]);
                else
                    *reinterpret_cast<float2*>(out + at) = make_float2(add_rn(0.0f, y[0]), add_rn(0.0f, y[1]));
            }
}

template <int NT, int MTILES>
__device__ __forceinline__ void zero(float (&acc)[NT][MTILES][4]) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < MTILES; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][i][e] = 0.0f;
}

// Ring engine: every operand streamed into shared memory by cp.async through a ring of
// 3 (or 2) K chunks, so bytes stay in flight while the warps compute, at no register cost. A CTA is THREADS / 32
// warps, 8*NT outputs each; a chunk holds KC blocks of the CTA's payload, scales (mins, high bits) and the pass's
// activation rows, padded to 48 bytes so the fragment loads are conflict-free, and their (d_a, sum_a) pairs. Rows
// past M and outputs past N are zero-filled by the copy itself (src-size 0). One barrier per chunk; every loop has a
// compile-time trip count. Every codebook: Q8_0's 32-byte payload rows are two 16-byte pieces (ring_weights); the
// super-block formats' chunks lie in one super-block and hold Q4_K/Q5_K's pairs and Q6_K's quads of blocks, which
// share their rows, whole; they stage their super-blocks' d (dmin) and sub-block scales, and a pass behind a second
// barrier derives each block's scale (min) once per chunk (ring_derive).

constexpr int ROW_WORDS = 12;  // a 32-byte row + 16 bytes of padding: rows g = 0..7 land on distinct banks
// Shared memory a CTA may take without opting in: registry.SHARED_MEMORY_LIMIT (tests/test_compile.py).
constexpr int STATIC_SHARED = 49152;
// The ring's shared memory per CTA: kpar's CTAs are many and short (S per column range), so its ring is 32 KB (7 CTAs
// per SM instead of 4); wide keeps all the static 48 KB, whose deeper chunks it measured faster.
constexpr int ring_shared(bool grid_split) { return grid_split ? 32 * 1024 : STATIC_SHARED; }

// One chunk's layout in shared memory, in 32-bit words (every part a multiple of 4 words: 16-byte aligned).
template <int CB, int NT, int ROWS_, int KC_, int THREADS>
struct Chunk {
    typedef Traits<CB> T;
    static constexpr int KC = KC_, OUT = THREADS / 32 * 8 * NT, ROWS = ROWS_;
    static constexpr int PAY = KC * OUT * T::WORDS;
    // Super-block formats (whose chunks start on a multiple of KC, which divides 8: a chunk lies in one super-block):
    // the super-block's fp16 d (dmin) and sub-scale bytes (6, 12 or 16) of every output, and the code bits above the
    // nibbles: Q5_K's 8 qh words of the super-block, Q6_K's 2 of each block (rows QH_ROW words apart: the 16 words of
    // padding put the rows a lane's t / 2 picks on the two halves of the banks). The legacy formats: an fp16 scale
    // (and min, high-bit word) per block and output.
    static constexpr int SCALE = T::SUPER ? OUT / 2 : KC * OUT / 2, SUB = OUT * T::SUB_BYTES / 4;
    static constexpr int MIN = T::ASYM ? SCALE : 0, HIGH = T::HIGH ? KC * OUT : 0;
    static constexpr int QH_ROW = CB == Q6_K ? 2 * OUT + 16 : OUT;
    static constexpr int QH = CB == Q5_K ? 8 * QH_ROW : CB == Q6_K ? KC * QH_ROW : 0;
    static constexpr int Q = KC * ROWS * ROW_WORDS, DS = 2 * KC * ROWS;  // a row's (d_a, sum_a): one 8-byte load
    static constexpr int pay = 0, scale = pay + PAY, sub = scale + SCALE, min = sub + SUB, high = min + MIN;
    static constexpr int qh = high + HIGH, q = qh + QH, ds = q + Q, words = ds + DS;
    // The super-block formats' d_w (per half) and m_w of the chunk's (block, output)s, which ring_derive makes once
    // the chunk has landed: one array beside the ring, since a chunk's are read only between its two barriers.
    static constexpr int DW = T::SUPER ? T::HALVES * KC * OUT : 0, MW = T::SUPER && T::ASYM ? KC * OUT : 0;
    static constexpr int dw = 0, mw = DW, derived = DW + MW;
    // Shared memory of a ring of `stages` such chunks and its derived scales, in bytes.
    static constexpr int bytes(int stages) { return 4 * (stages * words + derived); }
};

// The super-block formats' derived scales of a chunk (Chunk::derived floats), beside the ring; none for the others.
// (Indexing one array of the chunks and these cost the legacy rings up to 20 registers.)
template <int FLOATS>
__device__ __forceinline__ float* derived_scales() {
    if constexpr (FLOATS == 0) {
        return nullptr;
    } else {
        __shared__ __align__(16) float derived[FLOATS];
        return derived;
    }
}

// Stages and blocks per chunk: 3 stages where 3 chunks of the fewest blocks a chunk may hold (2; Q6_K's quads: 4) fit
// the static shared memory, else 2 (Q6_K's rings of 128 outputs); then 8 blocks, else 4, whichever ring fits the
// family's shared memory, else the fewest. Only Q8_0's 2-block chunks of 128 outputs and 32 rows (36 KB) and Q6_K's
// rings, but for those of 64 outputs and 8 rows (35-48 KB), exceed kpar's 32 KB.
template <int CB, int NT, int ROWS, bool GRID_SPLIT, int THREADS>
struct RingShape {
    static constexpr int LIMIT = ring_shared(GRID_SPLIT), KC_MIN = Traits<CB>::GROUP > 2 ? Traits<CB>::GROUP : 2;
    template <int KC>
    using ChunkOf = Chunk<CB, NT, ROWS, KC, THREADS>;
    static constexpr int ST = ChunkOf<KC_MIN>::bytes(3) <= STATIC_SHARED ? 3 : 2;
    static constexpr int KC = ChunkOf<8>::bytes(ST) <= LIMIT ? 8
                            : KC_MIN <= 4 && ChunkOf<4>::bytes(ST) <= LIMIT ? 4 : KC_MIN;
    typedef ChunkOf<KC> C;
    static_assert(C::bytes(ST) <= STATIC_SHARED, "a ring must fit the static shared memory");
};

// Q8_0's payload rows are two 16-byte pieces; outputs with bit 2 set hold them swapped, so word t of the 8 outputs
// of a tile (lanes g, t) lies on 32 distinct banks. The piece of (output o, half h) within its row:
template <int CB>
__device__ __forceinline__ int ring_piece(int o, int h) {
    return Traits<CB>::WORDS == 8 ? h ^ ((o >> 2) & 1) : h;
}

// The ring's B (or swapped A) words per block and output: one pair, or the lookup's two addends (iq4nl_addends).
template <int CB>
constexpr int RING_ADDENDS = Traits<CB>::TABLE ? 2 : 1;

// Elements 4t.. (w_out[0][0]) and 16+4t.. (w_out[0][1]) of output o's row of block u in a landed chunk, as int8
// words; the lookup codebooks: payload word t as the two addends of iq4nl_addends (w_out[x], in iq4nl_pairs' order),
// so the ring puts the activations it pairs them with in that order (to_selector_pair).
// Q4_K/Q5_K's blocks u and u ^ 1 share their two payload rows (chunks start on a pair): block u takes nibble u & 1,
// and Q5_K bit j = first + u (its place in the super-block) of the qh words t and 4+t. Q6_K's quad of rows (chunks
// start on a quad) holds its four blocks as decode_paired reads them, their two code bits in the qh words of
// elements 4t.. (row t / 2 of the quad, word t % 2) and 16+4t.. (row 2 + t / 2).
template <int CB, typename C>
__device__ __forceinline__ void ring_weights(const u32* slot, int u, int first, int o, int t,
                                             int (&w_out)[RING_ADDENDS<CB>][2]) {
    typedef Traits<CB> T;
    int& lo = w_out[0][0];
    int& hi = w_out[0][1];
    if constexpr (T::TABLE) {
        u32 low[2], high[2];
        iq4nl_addends(slot[C::pay + (u * C::OUT + o) * T::WORDS + t], low, high);
        w_out[0][0] = (int)low[0], w_out[0][1] = (int)low[1];
        w_out[RING_ADDENDS<CB> - 1][0] = (int)high[0], w_out[RING_ADDENDS<CB> - 1][1] = (int)high[1];
    } else if constexpr (CB == Q6_K) {
        const int quad = u & ~3, ub = u & 3, r = quad + 2 * (ub & 1);  // the rows of block ub of the quad
        const u32* w = slot + C::pay + o * T::WORDS + t;
        const u32* qh = slot + C::qh + quad * C::QH_ROW + 2 * o + (t & 1);
        decode_paired<CB>(w[r * C::OUT * T::WORDS], w[(r + 1) * C::OUT * T::WORDS],
                          q6k_high(qh[(t >> 1) * C::QH_ROW], ub), q6k_high(qh[(2 + (t >> 1)) * C::QH_ROW], ub), ub, lo,
                          hi);
    } else if constexpr (T::GROUP == 2) {
        const u32* w = slot + C::pay + o * T::WORDS + t;
        const u32* qh = slot + C::qh + t * C::QH_ROW + o;
        const u32 h0 = CB == Q5_K ? q5k_high(qh[0], first + u) : 0u;
        const u32 h1 = CB == Q5_K ? q5k_high(qh[4 * C::QH_ROW], first + u) : 0u;
        decode_paired<CB>(w[(u & ~1) * C::OUT * T::WORDS], w[(u | 1) * C::OUT * T::WORDS], h0, h1, u & 1, lo, hi);
    } else {
        const u32* w = slot + C::pay + (u * C::OUT + o) * T::WORDS + t;
        const u32 high = T::HIGH ? slot[C::high + u * C::OUT + o] : 0u;
        decode_word<CB>(w[4 * ring_piece<CB>(o, 0)], T::WORDS == 8 ? w[4 * ring_piece<CB>(o, 1)] : 0u, high, t, lo, hi);
    }
}

// Super-block formats: every (block u, output) of a landed chunk derives its d_w (per half) and m_w once into
// `derived` (C::dw, C::mw: [half][u][output], [u][output]), from the staged d (dmin) and sub-block scales of its
// super-block (block u is block first + u of it), as the dp4a engine's `derive` does (§2); every lane that needs
// them reads them after the chunk's second barrier.
template <int CB, typename C, int THREADS>
__device__ __forceinline__ void ring_derive(const u32* slot, float* derived, int first, int tid) {
    typedef Traits<CB> T;
    const u16* d = reinterpret_cast<const u16*>(slot + C::scale);
    const u16* dmin = reinterpret_cast<const u16*>(slot + C::min);
#pragma unroll
    for (int i = 0; i < (C::KC * C::OUT + THREADS - 1) / THREADS; ++i) {
        const int e = tid + i * THREADS, u = e / C::OUT, at = e % C::OUT;
        if ((C::KC * C::OUT) % THREADS && e >= C::KC * C::OUT) break;
        const int j = (first + u) & 7;
        const SubScales s = sub_record<CB>(
            reinterpret_cast<const unsigned char*>(slot + C::sub) + at * T::SUB_BYTES + sub_offset<CB>(j),
            [](const auto* q) { return *q; });
        float d_w[T::HALVES], m_w = 0.0f;
        derive<CB, false>(half_bits_to_float(d[at]), T::ASYM ? half_bits_to_float(dmin[at]) : 0.0f, s, j, d_w, m_w);
#pragma unroll
        for (int h = 0; h < T::HALVES; ++h) derived[C::dw + h * C::KC * C::OUT + e] = d_w[h];
        if (T::ASYM) derived[C::mw + e] = m_w;
    }
}

// One part of a ring chunk: KC blocks of PER pieces each, piece e = u * PER + item. Thread `tid` copies pieces tid,
// tid + THREADS, ...: PER divides THREADS, so its item is the same in every round (and every chunk: what depends on
// the item alone may be kept across the chunk loop) and its block advances by THREADS / PER per round.
template <int KC, int PER, int THREADS, typename Copy>
__device__ __forceinline__ void for_pieces(int tid, Copy copy) {
    static_assert(THREADS % PER == 0, "a thread's item must not change between rounds");
    constexpr int STEP = THREADS / PER;
    const int item = tid % PER, u0 = tid / PER;
#pragma unroll
    for (int i = 0; i < (KC + STEP - 1) / STEP; ++i) {
        const int u = u0 + i * STEP;
        if (KC % STEP == 0 || u < KC) copy(u, item, u * PER + item);
    }
}

// Blocks [u_lo, cn) of a landed ring chunk (u_lo = 1 where a partition starts on a pair's second block) for the
// warp's first `tiles` 8-output tiles, `left` = M minus the pass's first row (rows past M are zero-filled, so
// computing them is harmless; mma_tile skips the float work of empty halves).
template <int CB, int NT, int MTILES, bool GRID_SPLIT, int THREADS>
__device__ __forceinline__ void ring_chunk(const u32* slot, const float* derived, int u_lo, int cn, int first,
                                           int tiles, int left, int o_warp, int g, int t, float (&acc)[NT][MTILES][4]) {
    typedef Traits<CB> T;
    constexpr int H = T::HALVES;
    typedef typename RingShape<CB, NT, 16 * MTILES, GRID_SPLIT, THREADS>::C C;
    constexpr int KC = C::KC, OUT = C::OUT, ROWS = C::ROWS;
#pragma unroll
    for (int u = 0; u < KC; ++u) {
        if (u >= cn) break;  // block-uniform
        if (u < u_lo) continue;
        int a[MTILES][4];
        RowBlock<CB> rows[MTILES][2];
#pragma unroll
        for (int i = 0; i < MTILES; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * i + 8 * h + g;
                const u32* q = slot + C::q + (u * ROWS + r) * ROW_WORDS;
                a[i][h] = (int)q[t];
                a[i][2 + h] = (int)q[4 + t];
                if (T::TABLE) to_selector_pair(a[i][h], a[i][2 + h]);  // the order of the weights' addends
                const uint2 ds = *reinterpret_cast<const uint2*>(slot + C::ds + 2 * (u * ROWS + r));
                rows[i][h] = RowBlock<CB>::of(__uint_as_float(ds.x), (int)ds.y);
            }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (j >= tiles) break;  // warp-uniform
            const int pair = (u * OUT + o_warp + 8 * j) / 2 + t;  // scales of outputs 2t, 2t+1 of the tile
            const u32 scales = T::SUPER ? 0u : slot[C::scale + pair];
            const u32 mins = T::ASYM && !T::SUPER ? slot[C::min + pair] : 0u;
            int b[RING_ADDENDS<CB>][2];
            ring_weights<CB, C>(slot, u, first, o_warp + 8 * j + g, t, b);
            float d_w[2][H] = {{half_bits_to_float(scales & 0xFFFFu)}, {half_bits_to_float(scales >> 16)}};
            float m_w[2] = {half_bits_to_float(mins & 0xFFFFu), half_bits_to_float(mins >> 16)};
            if constexpr (T::SUPER) {  // outputs 2t, 2t+1: one 8-byte load of each (per half)
                const int at = u * OUT + o_warp + 8 * j + 2 * t;
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    const float2 dw = *reinterpret_cast<const float2*>(derived + C::dw + h * KC * OUT + at);
                    d_w[0][h] = dw.x, d_w[1][h] = dw.y;
                }
                if (T::ASYM) {
                    const float2 mw = *reinterpret_cast<const float2*>(derived + C::mw + at);
                    m_w[0] = mw.x, m_w[1] = mw.y;
                }
            }
            mma_tile<CB, MTILES>(a, rows, b, d_w, m_w, left, acc[j]);
        }
    }
}

// Blocks [u_lo, cn) of a landed ring chunk with the operands swapped (M <= 8): A = the weights of 16 outputs (a pair of
// the warp's 8-output tiles: lane (g, t) decodes word t of outputs g and g+8), B = the pass's 8 activation rows (row
// g's words t and 4+t), so C holds outputs g, g+8 by rows 2t, 2t+1: every C value a row of the pass, where the
// activation-as-A form leaves rows g+8 empty. acc[j][0][e] is output 8j+g (of the warp's first), row 2t+e; a pair
// whose upper tile lies past N computes zero-filled outputs that mma_store_weights_a skips.
template <int CB, int NT, bool GRID_SPLIT, int THREADS>
__device__ __forceinline__ void ring_chunk_weights_a(const u32* slot, const float* derived, int u_lo, int cn,
                                                     int first, int tiles, int o_warp, int g, int t,
                                                     float (&acc)[NT][1][4]) {
    typedef Traits<CB> T;
    typedef typename RingShape<CB, NT, 8, GRID_SPLIT, THREADS>::C C;
    constexpr int KC = C::KC, OUT = C::OUT, ROWS = C::ROWS, H = T::HALVES;
    const u16* scales = reinterpret_cast<const u16*>(slot + C::scale);
    const u16* mins = reinterpret_cast<const u16*>(slot + C::min);
#pragma unroll
    for (int u = 0; u < KC; ++u) {
        if (u >= cn) break;  // block-uniform
        if (u < u_lo) continue;
        const u32* q = slot + C::q + (u * ROWS + g) * ROW_WORDS;
        int b0 = (int)q[t], b1 = (int)q[4 + t];
        if (T::TABLE) to_selector_pair(b0, b1);  // the order of the weights' addends
        const uint4 ds = *reinterpret_cast<const uint4*>(slot + C::ds + 2 * (u * ROWS + 2 * t));  // rows 2t, 2t+1
        const RowBlock<CB> rows[2] = {RowBlock<CB>::of(__uint_as_float(ds.x), (int)ds.y),
                                      RowBlock<CB>::of(__uint_as_float(ds.z), (int)ds.w)};
        const int c_in[4] = {rows[0].bias, rows[1].bias, rows[0].bias, rows[1].bias};
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            if (j >= tiles) break;  // warp-uniform
            int w[2][RING_ADDENDS<CB>][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)  // A rows g (outputs of tile j) and g+8 (tile j+1)
                ring_weights<CB, C>(slot, u, first, o_warp + 8 * (j + h) + g, t, w[h]);
            int c[H][4];
#pragma unroll
            for (int x = 0; x < RING_ADDENDS<CB>; ++x) {  // the lookup's addends: an mma each
                const int a[4] = {w[0][x][0], w[1][x][0], w[0][x][1], w[1][x][1]};
                if (x == 0)
                    mma_block<H>(a, b0, b1, c_in, c);
                else
                    mma_s8(a, b0, b1, c[0], c[0]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int o = u * OUT + o_warp + 8 * (j + h) + g;
                float d_w[H];
#pragma unroll
                for (int q = 0; q < H; ++q)
                    d_w[q] = T::SUPER ? derived[C::dw + q * KC * OUT + o] : half_bits_to_float(scales[o]);
                const float m_w = !T::ASYM ? 0.0f : T::SUPER ? derived[C::mw + o] : half_bits_to_float(mins[o]);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int biased[H];
#pragma unroll
                    for (int q = 0; q < H; ++q) biased[q] = c[q][2 * h + e];
                    acc[j + h][0][e] = add_rn(acc[j + h][0][e], rows[e].term(biased, d_w, m_w));
                }
            }
        }
    }
}

// ring_chunk_weights_a's results for one pass of 8 rows from m0: output 8j+g of the warp, rows 2t, 2t+1.
template <int NT, bool GRID_SPLIT>
__device__ __forceinline__ void mma_store_weights_a(const float (&acc)[NT][1][4], float* __restrict__ out, int p, int m0,
                                                    int M, int N, int n_first, int tiles, int g, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int r = m0 + 2 * t + e;
            if (j >= tiles || r >= M) continue;
            const u64 at = (GRID_SPLIT ? ((u64)p * M + r) : (u64)r) * N + n_first + 8 * j + g;
            out[at] = GRID_SPLIT ? acc[j][0][e] : add_rn(0.0f, acc[j][0][e]);
        }
}

template <int CB, int NT, int MTILES, bool GRID_SPLIT, int THREADS, bool WEIGHTS_A>
__device__ __forceinline__ void mma_ring(GEMV_PARAMS) {
    typedef Traits<CB> T;
    // Rows of M per pass: 8 with the weights as the A operand, else 16 per M tile.
    typedef RingShape<CB, NT, WEIGHTS_A ? 8 : 16 * MTILES, GRID_SPLIT, THREADS> Shape;
    typedef typename Shape::C C;
    constexpr int KC = C::KC, OUT = C::OUT, ROWS = C::ROWS, ST = Shape::ST;
    static_assert(!WEIGHTS_A || (MTILES == 1 && NT % 2 == 0), "the weights as A: one pass of 8 rows, tiles in pairs");
    __shared__ __align__(16) u32 ring[ST][C::words];
    float* derived = derived_scales<C::derived>();

    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n_cta = blockIdx.x * OUT;
    const int o_warp = (tid >> 5) * 8 * NT;
    const int tiles = n_cta + o_warp < N ? min(NT, (N - n_cta - o_warp) / 8) : 0;  // warp-uniform
    const int p = GRID_SPLIT ? blockIdx.y : 0;
    const int b_begin = p * width;
    const int b_end = min(KB, b_begin + width);
    // The super-block formats' chunks start on multiples of KC (a chunk in one super-block, its pairs or quads whole):
    // [b_lo, b_hi) covers the partition, whose blocks alone are computed.
    constexpr int ALIGN = T::SUPER ? KC : 1;
    const int b_lo = b_begin / ALIGN * ALIGN, b_hi = ALIGN == 1 ? b_end : min(KB, (b_end + ALIGN - 1) / ALIGN * ALIGN);
    const int chunks = (b_hi - b_lo + KC - 1) / KC;

    const SharedBytes ring_at = shared_at(ring);
    // Blocks, columns and rows out of range are clamped to valid addresses; their copies zero-fill (src-size 0).
    const int last_block = b_hi - 1;
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        const int left = M - m0;  // the pass's rows below M
        // Chunk c into ring slot c % ST: consecutive threads on consecutive pieces of each part.
        auto issue = [&](int c) {
            const SharedBytes slot = ring_at + c % ST * (C::words * 4);
            const int b0 = b_lo + c * KC, cn = min(KC, b_hi - b0);
            auto block = [&](int u) { return min(b0 + u, last_block); };
            auto column = [&](int o) { return min(n_cta + o, N - 1); };
            auto row = [&](int r) { return min(m0 + r, M - 1); };
            // 16 bytes of a payload row; a thread's item is one piece where the pieces of a block fit the CTA
            // (consecutive threads on consecutive bytes), else one row.
            constexpr int PIECES = T::WORDS / 4, PER_ITEM = THREADS % (OUT * PIECES) == 0 ? 1 : PIECES;
            for_pieces<KC, OUT * PIECES / PER_ITEM, THREADS>(tid, [&](int u, int item, int e) {
                const int o = item * PER_ITEM / PIECES;
                const bool ok = u < cn && n_cta + o < N;
                const u32* row = payload + (u64)block_index(block(u), N, column(o)) * T::WORDS;
#pragma unroll
                for (int i = 0; i < PER_ITEM; ++i) {
                    const int h = (item * PER_ITEM + i) % PIECES;
                    cp_async<16>(slot + 4 * (C::pay + (u * OUT + o) * T::WORDS + 4 * ring_piece<CB>(o, h)), row + 4 * h, ok);
                }
            });
            if constexpr (T::SUPER) {
                // The chunk's super-block: 8 fp16 d (dmin), 16-byte pieces of the outputs' sub-scale records
                // (N % 8 == 0: N ends on a piece), Q5_K's 4 qh words; Q6_K's 2 qh words of 2 outputs a block.
                const int sb = b0 >> 3;
                for_pieces<1, OUT / 8, THREADS>(tid, [&](int, int o8, int e) {
                    const bool ok = n_cta + 8 * o8 < N;
                    const u32 at = block_index(sb, N, column(8 * o8));
                    cp_async<16>(slot + 4 * C::scale + 16 * e, scale + at, ok);
                    if (T::ASYM) cp_async<16>(slot + 4 * C::min + 16 * e, minv + at, ok);
                });
                for_pieces<T::SUB_BYTES / 2, OUT / 8, THREADS>(tid, [&](int r, int item, int e) {  // OUT * SUB_BYTES
                    const int piece = r * (OUT / 8) + item;
                    const bool ok = 16 * piece < T::SUB_BYTES * (N - n_cta);
                    const unsigned char* src = sub + (u64)block_index(sb, N, n_cta) * T::SUB_BYTES + 16 * piece;
                    cp_async<16>(slot + 4 * C::sub + 16 * e, ok ? src : sub, ok);
                });
                if (CB == Q5_K)
                    for_pieces<8, OUT / 4, THREADS>(tid, [&](int i, int o4, int e) {
                        const bool ok = n_cta + 4 * o4 < N;
                        cp_async<16>(slot + 4 * C::qh + 16 * e, high + block_index(8 * sb + i, N, column(4 * o4)), ok);
                    });
                if (CB == Q6_K)
                    for_pieces<KC, OUT / 2, THREADS>(tid, [&](int u, int o2, int) {
                        const bool ok = u < cn && n_cta + 2 * o2 < N;
                        const u32* src = high + (u64)block_index(block(u), N, column(2 * o2)) * 2;
                        cp_async<16>(slot + 4 * (C::qh + u * C::QH_ROW + 2 * (2 * o2)), src, ok);
                    });
            } else {
                for_pieces<KC, OUT / 8, THREADS>(tid, [&](int u, int o8, int e) {  // 8 fp16 scales (mins)
                    const bool ok = u < cn && n_cta + 8 * o8 < N;
                    const u32 at = block_index(block(u), N, column(8 * o8));
                    cp_async<16>(slot + 4 * C::scale + 16 * e, scale + at, ok);
                    if (T::ASYM) cp_async<16>(slot + 4 * C::min + 16 * e, minv + at, ok);
                });
            }
            if (T::HIGH)
                for_pieces<KC, OUT / 4, THREADS>(tid, [&](int u, int o4, int e) {  // 4 high-bit words
                    const bool ok = u < cn && n_cta + 4 * o4 < N;
                    cp_async<16>(slot + 4 * C::high + 16 * e, high + block_index(block(u), N, column(4 * o4)), ok);
                });
            for_pieces<KC, 2 * ROWS, THREADS>(tid, [&](int u, int rh, int e) {  // half an activation row
                const int r = rh >> 1, half = rh & 1;
                const bool ok = u < cn && r < left;
                const int* src = qa + (u64)block_index(block(u), M, row(r)) * 8 + 4 * half;
                cp_async<16>(slot + 4 * (C::q + (u * ROWS + r) * ROW_WORDS + 4 * half), src, ok);
            });
            for_pieces<KC, ROWS, THREADS>(tid, [&](int u, int r, int e) {  // a row's (d_a, sum_a)
                const bool ok = u < cn && r < left;
                const u32 at = block_index(block(u), M, row(r));
                cp_async<4>(slot + 4 * (C::ds + 2 * e), da + at, ok);
                cp_async<4>(slot + 4 * (C::ds + 2 * e + 1), sa + at, ok);
            });
        };

        float acc[NT][MTILES][4];
        zero(acc);
        constexpr int ROWS_ALL = 16 * MTILES;  // the pass's rows
#pragma unroll
        for (int c = 0; c < ST - 1; ++c) {
            if (c < chunks) issue(c);
            cp_async_commit();  // empty groups keep the count of pending groups uniform
        }
        for (int c = 0; c < chunks; ++c) {
            cp_async_wait<ST - 2>();
            __syncthreads();  // chunk c has landed for every thread; slot (c - 1) % ST is free
            if (c + ST - 1 < chunks) issue(c + ST - 1);
            cp_async_commit();
            if constexpr (T::SUPER) {
                ring_derive<CB, C, THREADS>(ring[c % ST], derived, (b_lo + c * KC) & 7, tid);  // first
                __syncthreads();  // the chunk's d_w (m_w) are in place
            }
            if (tiles == 0) continue;
            const u32* slot = ring[c % ST];
            const int b0 = b_lo + c * KC, u_lo = ALIGN == 1 ? 0 : max(0, b_begin - b0), cn = min(KC, b_end - b0);
            const int first = b0 & 7;
            // Whole chunks of whole tiles, with rows in every 8-row half of the pass (or, for one M tile, in its first
            // half: M <= 8) are nearly every chunk: there the trip counts are constants, and the chunk's blocks one
            // branch-free stretch. (A third copy for two M tiles spilled gemv_mma<Q4_0, 4, 2, false>.)
            if constexpr (WEIGHTS_A) {
                if (u_lo == 0 && cn == KC && tiles == NT)
                    ring_chunk_weights_a<CB, NT, GRID_SPLIT, THREADS>(slot, derived, 0, KC, first, NT, o_warp, g, t,
                                                                      acc);
                else
                    ring_chunk_weights_a<CB, NT, GRID_SPLIT, THREADS>(slot, derived, u_lo, cn, first, tiles, o_warp, g,
                                                                      t, acc);
            } else if (u_lo == 0 && cn == KC && tiles == NT && left > ROWS_ALL - 8) {
                ring_chunk<CB, NT, MTILES, GRID_SPLIT, THREADS>(slot, derived, 0, KC, first, NT, ROWS_ALL, o_warp, g, t,
                                                                acc);
            } else if (MTILES == 1 && u_lo == 0 && cn == KC && tiles == NT && left > ROWS_ALL - 16) {
                ring_chunk<CB, NT, MTILES, GRID_SPLIT, THREADS>(slot, derived, 0, KC, first, NT, ROWS_ALL - 8, o_warp, g,
                                                                t, acc);
            } else {
                ring_chunk<CB, NT, MTILES, GRID_SPLIT, THREADS>(slot, derived, u_lo, cn, first, tiles, left, o_warp, g, t,
                                                                acc);
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the next M pass refills the ring
        float* to = GRID_SPLIT ? ws + ticket_words(N) : out;
        if constexpr (WEIGHTS_A)
            mma_store_weights_a<NT, GRID_SPLIT>(acc, to, p, m0, M, N, n_cta + o_warp, tiles, g, t);
        else
            mma_store<NT, MTILES, GRID_SPLIT>(acc, to, p, m0, M, N, n_cta + o_warp, tiles, g, t);
    }
}

// The tensor-core candidates (wide S = 1, kpar GRID_SPLIT), on the ring engine. THREADS is the CTA (the candidate's
// threads), whose warps share the ring's chunks.
// Told only a CTA size above 128, ptxas aims at 64 registers and spills some 8-warp instantiations; naming the
// CTAs per SM that the register cap still allows lets it use up to the cap. 128-thread CTAs keep ptxas's default
// (0: no minimum), whose registers are the measured ones. WEIGHTS_A (M <= 8, tiles in pairs): the ring's operands
// swapped (ring_chunk_weights_a); its chunks hold 8 rows, so its ring is smaller, and told no minimum ptxas aimed
// its 128-thread CTAs at the 5 per SM that the shared memory allows (96 registers) and spilled the IQ4_NL kernel:
// they name the register cap's CTAs per SM too, as do Q8_0's, whose rings of 2-4 block chunks are as small (told no
// minimum, ptxas spilled gemv_mma<Q8_0, 4, 1, false, 128, false> at 96 registers), and the super-block rings (told
// no minimum, ptxas spilled gemv_mma<IQ4_XS, 2, 2, false, 128, false> at 80 registers and
// gemv_mma<Q4_K, 2, 2, true, 128, false> at 80).
constexpr int REGISTER_FILE = 65536;  // per SM: registry.REGISTER_FILE (tests/test_compile.py)
constexpr int REGISTER_CAP = 128;     // per thread: --maxrregcount, program.MAX_REGISTERS (tests/test_compile.py)
template <int CB, int THREADS, bool WEIGHTS_A> constexpr int min_ctas_per_sm() {
    constexpr bool named = THREADS > 128 || WEIGHTS_A || CB == Q8_0 || Traits<CB>::SUPER;
    return named ? REGISTER_FILE / (THREADS * REGISTER_CAP) : 0;
}

template <int CB, int NT, int MTILES, bool GRID_SPLIT, int THREADS, bool WEIGHTS_A>
__global__ void __launch_bounds__(THREADS, min_ctas_per_sm<CB, THREADS, WEIGHTS_A>()) gemv_mma(GEMV_PARAMS) {
    mma_ring<CB, NT, MTILES, GRID_SPLIT, THREADS, WEIGHTS_A>(payload, high, scale, minv, sub, qa, da, sa, M, N, KB, width,
                                                             out, ws);
    if constexpr (GRID_SPLIT) {
        const int cols = blockDim.x / 32 * 8 * NT;
        fold_last<FOLD_FLOATS_RING>(ws, out, gridDim.y, M, N, blockIdx.x * cols, cols);
    }
}

// One warp per (row, block): lane j owns element j. Reads x row-major, writes block-major ([KB][M]).
extern "C" __global__ void quantize_activations(const float* __restrict__ x, int M, int KB, signed char* __restrict__ q,
                                                float* __restrict__ d, int* __restrict__ sums) {
    const int blk = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // m * KB + b
    const int lane = threadIdx.x & 31;
    if (blk >= M * KB) return;  // uniform per warp
    const float a = x[(u64)blk * 32 + lane];
    float amax = abs_f32(a);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = max_f32(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d_a = div_rn(amax, 127.0f);
    int qi = 0;
    if (__float_as_uint(d_a) != 0u)  // a bit test: a float compare would flush a subnormal d_a under ftz
        qi = to_int_rz(min_f32(max_f32(rint_f32(div_rn(a, d_a)), -127.0f), 127.0f));
    const int s = __reduce_add_sync(0xffffffffu, qi);
    const u64 to = (u64)(blk % KB) * M + blk / KB;
    q[to * 32 + lane] = (signed char)qi;
    if (lane == 0) {
        d[to] = d_a;
        sums[to] = s;
    }
}
