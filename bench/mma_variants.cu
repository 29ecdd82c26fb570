// Experiments (issue: small-batch speed), appended to kernels/cuda/gemv.cu by bench/mma_variants.py: variants of
// the tensor-core engine with the same arguments, arithmetic and accumulation order as gemv_mma, so for the same
// S their bytes must equal the registry's (the script checks before it times anything).
//
// gemv_mma_pipe (version 9; version 8 in bench/NOTES.md): every operand streamed into shared memory by cp.async
// through a 3-deep ring of K chunks, so bytes stay in flight while the warps compute, at no register cost
// (gemv_mma holds its prefetch in registers and has no load in flight while it computes the prefetched blocks).
// A CTA is 4 warps, 8*NT outputs each; a chunk holds KC blocks of the CTA's payload, scales (mins, high bits)
// and the M tile's activation rows. Rows are padded to 48 bytes (activations, and Q8_0's 32-byte payloads) so
// the fragment loads are conflict-free. Rows past M and outputs past N are zero-filled by the copy itself
// (src-size 0). One barrier per chunk; every loop has a compile-time trip count (unrolled, shifts for indices).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

constexpr int PIPE_THREADS = 128;
constexpr int PIPE_STAGES = 3;
constexpr int ROW_WORDS = 12;  // a 32-byte row + 16 bytes of padding: rows g = 0..7 land on distinct banks
constexpr int SMEM_LIMIT = 48 * 1024;

// One chunk's layout in shared memory, in 32-bit words (every part a multiple of 4 words: 16-byte aligned).
template <int CB, int NT, int MTILES, int KC_>
struct Chunk {
    typedef Traits<CB> T;
    static constexpr int KC = KC_, OUT = PIPE_THREADS / 32 * 8 * NT, ROWS = 16 * MTILES;
    static constexpr int PSTRIDE = T::WORDS == 8 ? ROW_WORDS : T::WORDS;  // payload words per output
    static constexpr int PAY = KC * OUT * PSTRIDE;
    static constexpr int SCALE = KC * OUT / 2, MIN = T::ASYM ? SCALE : 0, HIGH = T::HIGH ? KC * OUT : 0;
    static constexpr int Q = KC * ROWS * ROW_WORDS, D = KC * ROWS, S = KC * ROWS;
    static constexpr int pay = 0, scale = pay + PAY, min = scale + SCALE, high = min + MIN, q = high + HIGH;
    static constexpr int d = q + Q, s = d + D, words = s + S;
};

// Blocks per chunk: 8, else 4, else 2, whichever ring fits the static shared-memory limit.
template <int CB, int NT, int MTILES>
struct PipeShape {
    static constexpr int KC = PIPE_STAGES * Chunk<CB, NT, MTILES, 8>::words * 4 <= SMEM_LIMIT ? 8
                            : PIPE_STAGES * Chunk<CB, NT, MTILES, 4>::words * 4 <= SMEM_LIMIT ? 4 : 2;
    typedef Chunk<CB, NT, MTILES, KC> C;
};

template <int CB, int NT, int MTILES, bool GRID_SPLIT>
__global__ void __launch_bounds__(PIPE_THREADS)
gemv_mma_pipe(const u32* __restrict__ payload, const u32* __restrict__ high, const u16* __restrict__ scale,
              const u16* __restrict__ minv, const int* __restrict__ qa, const float* __restrict__ da,
              const int* __restrict__ sa, int M, int N, int KB, int width, float* __restrict__ out) {
    typedef Traits<CB> T;
    typedef typename PipeShape<CB, NT, MTILES>::C C;
    constexpr int KC = C::KC, OUT = C::OUT, ROWS = C::ROWS, ST = PIPE_STAGES, PIECES = T::WORDS / 4;
    __shared__ __align__(16) u32 ring[ST][C::words];

    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n_cta = blockIdx.x * OUT;
    const int o_warp = (tid >> 5) * 8 * NT;
    const int tiles = n_cta + o_warp < N ? min(NT, (N - n_cta - o_warp) / 8) : 0;  // warp-uniform
    const int p = GRID_SPLIT ? blockIdx.y : 0;
    const int b_begin = p * width;
    const int b_end = min(KB, b_begin + width);
    const int chunks = (b_end - b_begin + KC - 1) / KC;

    for (int m0 = 0; m0 < M; m0 += ROWS) {
        // Chunk c into ring slot c % ST: 16-byte pieces, consecutive threads on consecutive pieces.
        auto issue = [&](int c) {
            u32* slot = ring[c % ST];
            const int b0 = b_begin + c * KC, cn = min(KC, b_end - b0);
            constexpr int PAY_PIECES = KC * OUT * PIECES;
#pragma unroll
            for (int i = 0; i < (PAY_PIECES + PIPE_THREADS - 1) / PIPE_THREADS; ++i) {
                const int e = tid + i * PIPE_THREADS;
                const int u = e / (OUT * PIECES), o = e / PIECES % OUT, piece = e % PIECES;
                const bool ok = e < PAY_PIECES && u < cn && n_cta + o < N;
                const u32* src = payload + ((u64)(b0 + u) * N + n_cta + o) * T::WORDS + 4 * piece;
                if (e < PAY_PIECES) cp_async16(slot + C::pay + (u * OUT + o) * C::PSTRIDE + 4 * piece, ok ? src : payload, ok);
            }
            constexpr int SCALE_PIECES = KC * OUT / 8;
#pragma unroll
            for (int i = 0; i < (SCALE_PIECES + PIPE_THREADS - 1) / PIPE_THREADS; ++i) {
                const int e = tid + i * PIPE_THREADS;
                const int u = e / (OUT / 8), o = e % (OUT / 8) * 8;
                const bool ok = e < SCALE_PIECES && u < cn && n_cta + o < N;
                const u64 at = (u64)(b0 + u) * N + n_cta + o;
                if (e < SCALE_PIECES) {
                    cp_async16(slot + C::scale + (u * OUT + o) / 2, ok ? scale + at : scale, ok);
                    if (T::ASYM) cp_async16(slot + C::min + (u * OUT + o) / 2, ok ? minv + at : minv, ok);
                }
            }
            if (T::HIGH) {
                constexpr int HIGH_PIECES = KC * OUT / 4;
#pragma unroll
                for (int i = 0; i < (HIGH_PIECES + PIPE_THREADS - 1) / PIPE_THREADS; ++i) {
                    const int e = tid + i * PIPE_THREADS;
                    const int u = e / (OUT / 4), o = e % (OUT / 4) * 4;
                    const bool ok = e < HIGH_PIECES && u < cn && n_cta + o < N;
                    const u64 at = (u64)(b0 + u) * N + n_cta + o;
                    if (e < HIGH_PIECES) cp_async16(slot + C::high + u * OUT + o, ok ? high + at : high, ok);
                }
            }
            constexpr int Q_PIECES = KC * ROWS * 2;
#pragma unroll
            for (int i = 0; i < (Q_PIECES + PIPE_THREADS - 1) / PIPE_THREADS; ++i) {
                const int e = tid + i * PIPE_THREADS;
                const int u = e / (ROWS * 2), r = e / 2 % ROWS, half = e & 1;
                const bool ok = e < Q_PIECES && u < cn && m0 + r < M;
                const int* src = qa + ((u64)(b0 + u) * M + m0 + r) * 8 + 4 * half;
                if (e < Q_PIECES) cp_async16(slot + C::q + (u * ROWS + r) * ROW_WORDS + 4 * half, ok ? src : qa, ok);
            }
            constexpr int D_COPIES = KC * ROWS;
#pragma unroll
            for (int i = 0; i < (D_COPIES + PIPE_THREADS - 1) / PIPE_THREADS; ++i) {
                const int e = tid + i * PIPE_THREADS;
                const int u = e / ROWS, r = e % ROWS;
                const bool ok = e < D_COPIES && u < cn && m0 + r < M;
                const u64 ab = (u64)(b0 + u) * M + m0 + r;
                if (e < D_COPIES) {
                    cp_async4(slot + C::d + e, ok ? da + ab : da, ok);
                    cp_async4(slot + C::s + e, ok ? sa + ab : sa, ok);
                }
            }
        };

        float acc[MTILES][NT][4];
#pragma unroll
        for (int i = 0; i < MTILES; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

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
            if (tiles == 0) continue;
            const u32* slot = ring[c % ST];
            const int cn = min(KC, b_end - b_begin - c * KC);
#pragma unroll
            for (int u = 0; u < KC; ++u) {
                if (u >= cn) break;  // block-uniform
                int a[MTILES][4];
                RowBlock<CB> rows[MTILES][2];
#pragma unroll
                for (int i = 0; i < MTILES; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = 16 * i + 8 * h + g;  // zero-filled past M
                        const u32* q = slot + C::q + (u * ROWS + r) * ROW_WORDS;
                        a[i][h] = (int)q[t];
                        a[i][2 + h] = (int)q[4 + t];
                        rows[i][h] = RowBlock<CB>::of(__uint_as_float(slot[C::d + u * ROWS + r]),
                                                      (int)slot[C::s + u * ROWS + r]);
                    }
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    if (j >= tiles) break;  // warp-uniform
                    const int o = o_warp + 8 * j + g;
                    const u32* w = slot + C::pay + (u * OUT + o) * C::PSTRIDE;
                    const u32 w_hi = CB == Q8_0 ? w[4 + t] : 0u;
                    const u32 hb = T::HIGH ? slot[C::high + u * OUT + o] : 0u;
                    const int pair = (u * OUT + o_warp + 8 * j) / 2 + t;  // scales of outputs 2t, 2t+1 of the tile
                    const u32 scales = slot[C::scale + pair];
                    const u32 mins = T::ASYM ? slot[C::min + pair] : 0u;
                    int lo, hi;
                    decode_word<CB>(w[t], w_hi, hb, t, lo, hi);
                    const float d_w[2] = {half_bits_to_float(scales & 0xFFFFu), half_bits_to_float(scales >> 16)};
                    const float m_w[2] = {half_bits_to_float(mins & 0xFFFFu), half_bits_to_float(mins >> 16)};
#pragma unroll
                    for (int i = 0; i < MTILES; ++i) {
                        if (m0 + 16 * i >= M) break;  // warp-uniform
                        int cc[4];
                        mma_s8(a[i], lo, hi, cc);
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            if (h == 1 && m0 + 16 * i + 8 >= M) break;  // warp-uniform: no rows g+8
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                float& y = acc[i][j][2 * h + e];
                                y = add_rn(y, rows[i][h].term(cc[2 * h + e], d_w[e], m_w[e]));
                            }
                        }
                    }
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the next M pass refills the ring

#pragma unroll
        for (int i = 0; i < MTILES; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = m0 + 16 * i + 8 * h + g;
                    if (j >= tiles || r >= M) continue;
                    const u64 at = (GRID_SPLIT ? ((u64)p * M + r) : (u64)r) * N + n_cta + o_warp + 8 * j + 2 * t;
                    const float* y = acc[i][j] + 2 * h;
                    if (GRID_SPLIT)
                        *reinterpret_cast<float2*>(out + at) = make_float2(y[0], y[1]);
                    else
                        *reinterpret_cast<float2*>(out + at) = make_float2(add_rn(0.0f, y[0]), add_rn(0.0f, y[1]));
                }
    }
}
