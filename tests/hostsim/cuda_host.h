// The CUDA execution model on the host, just enough to run the GEMV kernels on a CPU: every thread of a CTA is a
// fiber (ucontext) on the calling thread, CTAs run one after another, __syncthreads is a CTA barrier and the
// warp-wide operations (mma.sync, shuffles) meet at a warp barrier; a fiber that reaches a barrier yields until
// the last one of its group arrives, and a finished one leaves its groups, as exited CUDA threads do.
// Deterministic: the same launch interleaves its threads the same way every time. Float operations the kernels
// write as PTX have host twins in the kernel source (GEMV_HOSTSIM), compiled with -ffp-contract=off: one IEEE fp32
// rounding each, as on the GPU. What this cannot show: timing, races, alignment faults, and anything the PTX
// assembler decides. The GPU tests remain the judge; this lets CI run the kernels' own code.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __shared__ static  // one array per instantiation, shared by the fibers of the CTA (CTAs run in turn)

struct uint4 { unsigned x, y, z, w; };
struct int4 { int x, y, z, w; };
struct uint2 { unsigned x, y; };
struct int2 { int x, y; };
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct dim3 { unsigned x = 1, y = 1, z = 1; };

namespace hostsim {

// A barrier of `size` fibers; `generation` counts its releases; `votes` of one generation become its `result`.
struct Group {
    int size = 0, arrived = 0, votes = 0, result = 0;
    unsigned long generation = 0;

    bool release_if_complete() {
        if (arrived < size) return false;
        arrived = 0, ++generation;
        result = votes, votes = 0;
        return true;
    }
};

struct Warp {
    Group meet;
    unsigned slots[32][8];
};

struct Thread {
    dim3 threadIdx, blockIdx, blockDim, gridDim;
    Group* cta;
    Warp* warp;
    unsigned char* shared;
    size_t shared_bytes;  // the launch's dynamic shared memory (%dynamic_smem_size)
    ucontext_t context;
    bool done;
    const Group* waiting;  // the barrier this thread waits at, and its generation then
    unsigned long generation;

    bool runnable() const { return !done && !(waiting && waiting->generation == generation); }
};

struct Launch {
    ucontext_t scheduler;
    std::vector<Thread> threads;
    size_t current = 0;
    void (*kernel)(void* const*) = nullptr;
    void* const* args = nullptr;
};

inline Launch* running;
inline Thread& self() { return running->threads[running->current]; }

inline unsigned lane() {
    const Thread& t = self();
    return (t.threadIdx.x + t.blockDim.x * (t.threadIdx.y + t.blockDim.y * t.threadIdx.z)) & 31u;
}

inline void wait_at(Group& g) {
    Thread& t = self();
    t.waiting = &g, t.generation = g.generation;
    ++g.arrived;
    if (!g.release_if_complete()) swapcontext(&t.context, &running->scheduler);  // resumed once released
    t.waiting = nullptr;
}

// Every lane publishes `n` words, then reads the whole warp's; the second barrier keeps the slots until all read.
template <int n>
inline void exchange(const unsigned (&mine)[n], unsigned (&all)[32][8]) {
    Warp& w = *self().warp;
    std::memcpy(w.slots[lane()], mine, sizeof mine);
    wait_at(w.meet);
    std::memcpy(all, w.slots, sizeof all);
    wait_at(w.meet);
}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 with C = the lane's c (as D's layout). Fragments
// of lane (g, t) = (lane / 4, lane % 4):
// A row g: a0 (k 4t..4t+3), a2 (k 16+4t..); row g+8: a1, a3. B column g: b0 (k 4t..4t+3), b1 (k 16+4t..).
// D: d0, d1 = row g, columns 2t, 2t+1; d2, d3 = row g+8.
inline void mma_m16n8k32_s8(const int (&a)[4], int b0, int b1, const int (&c)[4], int (&d)[4]) {
    const unsigned mine[6] = {(unsigned)a[0], (unsigned)a[1], (unsigned)a[2], (unsigned)a[3], (unsigned)b0,
                              (unsigned)b1};
    unsigned all[32][8];
    exchange(mine, all);
    const int g = lane() >> 2, t = lane() & 3;
    auto a_at = [&](int row, int k) {  // A[row][k]
        const unsigned word = all[(row & 7) * 4 + (k & 15) / 4][(row >= 8) + 2 * (k >= 16)];
        return (int)(signed char)(word >> (8 * (k & 3)));
    };
    auto b_at = [&](int k, int col) {  // B[k][col]
        const unsigned word = all[col * 4 + (k & 15) / 4][4 + (k >= 16)];
        return (int)(signed char)(word >> (8 * (k & 3)));
    };
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        int s = c[e];
        for (int k = 0; k < 32; ++k) s += a_at(row, k) * b_at(k, col);
        d[e] = s;
    }
}

using Kernel = void (*)(void* const* args);

// A finished thread leaves its barriers: the others no longer wait for it.
inline void leave(Group& g) {
    --g.size;
    g.release_if_complete();
}

inline void run_thread() {
    running->kernel(running->args);
    Thread& t = self();
    t.done = true;
    leave(*t.cta);
    leave(t.warp->meet);
}  // returns to the scheduler through uc_link

constexpr size_t STACK_BYTES = 64 * 1024;

enum Outcome { DONE = 0, DEADLOCK = 2, PAST_SHARED = 3 };
constexpr size_t GUARD_BYTES = 64;  // behind the dynamic shared memory, each set to GUARD: a write there is reported
constexpr unsigned char GUARD = 0xA5;

// Run `kernel` over the grid: one fiber per CUDA thread, CTAs in order, `shared` bytes of dynamic shared memory
// per CTA. DONE after the last CTA; DEADLOCK at once when the threads of a CTA deadlock at barriers (a GPU would
// hang); PAST_SHARED when a CTA wrote past the launch's dynamic shared memory.
inline Outcome launch(Kernel kernel, dim3 grid, dim3 block, size_t shared, void* const* args) {
    const unsigned count = block.x * block.y * block.z;
    Launch here;
    here.kernel = kernel, here.args = args;
    here.threads.resize(count);
    std::vector<std::vector<unsigned char>> stacks(count, std::vector<unsigned char>(STACK_BYTES));
    std::vector<Warp> warps((count + 31) / 32);
    std::vector<unsigned char> memory(shared + GUARD_BYTES, GUARD);
    Group cta;
    Launch* outer = running;
    running = &here;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                cta = Group{(int)count};
                for (unsigned w = 0; w < warps.size(); ++w) warps[w].meet = Group{(int)std::min(32u, count - 32 * w)};
                for (unsigned tid = 0; tid < count; ++tid) {
                    Thread& t = here.threads[tid];
                    t.blockDim = block, t.gridDim = grid, t.blockIdx = dim3{x, y, z};
                    t.threadIdx = dim3{tid % block.x, tid / block.x % block.y, tid / (block.x * block.y)};
                    t.cta = &cta, t.warp = &warps[tid / 32], t.shared = memory.data(), t.shared_bytes = shared, t.done = false;
                    t.waiting = nullptr;
                    getcontext(&t.context);
                    t.context.uc_stack.ss_sp = stacks[tid].data();
                    t.context.uc_stack.ss_size = STACK_BYTES;
                    t.context.uc_link = &here.scheduler;
                    makecontext(&t.context, run_thread, 0);
                }
                for (bool busy = true; busy;) {  // round robin until every thread of the CTA has finished
                    busy = false;
                    bool ran = false;
                    for (here.current = 0; here.current < count; ++here.current) {
                        Thread& t = here.threads[here.current];
                        busy = busy || !t.done;
                        if (!t.runnable()) continue;
                        ran = true;
                        swapcontext(&here.scheduler, &t.context);
                    }
                    if (busy && !ran) {  // every live thread waits at a barrier the others never reach
                        running = outer;
                        return DEADLOCK;
                    }
                }
            }
    running = outer;
    for (size_t i = shared; i < memory.size(); ++i)
        if (memory[i] != GUARD) return PAST_SHARED;
    return DONE;
}

}  // namespace hostsim

#define threadIdx (hostsim::self().threadIdx)
#define blockIdx (hostsim::self().blockIdx)
#define blockDim (hostsim::self().blockDim)
#define gridDim (hostsim::self().gridDim)

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

template <class T>
inline T __ldg(const T* p) { return *p; }
inline void __syncthreads() { hostsim::wait_at(*hostsim::self().cta); }
inline int __syncthreads_or(int predicate) {  // read before this thread can reach the next barrier
    hostsim::Group& cta = *hostsim::self().cta;
    cta.votes += predicate != 0;
    hostsim::wait_at(cta);
    return cta.result;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {  // no two fibers run at once: a plain update is atomic
    const unsigned old = *p;
    *p = old + v;
    return old;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }

// prmt.b32 (default mode): byte i of the result is byte s_i & 7 of {b, a} (a bytes 0-3), or with s_i & 8 that
// byte's sign replicated; only bits 0-15 of s are read.
inline unsigned prmt(unsigned a, unsigned b, unsigned s) {
    const unsigned long long ab = ((unsigned long long)b << 32) | a;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 0xF;
        unsigned byte = (unsigned)(ab >> (8 * (sel & 7))) & 0xFF;
        if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0;
        r |= byte << (8 * i);
    }
    return r;
}

// shf.r.wrap.b32: the low 32 bits of {hi, lo} shifted right by shift & 31.
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}

inline float __shfl_xor_sync(unsigned, float v, int mask) {
    unsigned all[32][8];
    const unsigned mine[1] = {__float_as_uint(v)};
    hostsim::exchange(mine, all);
    return __uint_as_float(all[hostsim::lane() ^ (unsigned)mask][0]);
}

inline int __reduce_add_sync(unsigned, int v) {
    unsigned all[32][8];
    const unsigned mine[1] = {(unsigned)v};
    hostsim::exchange(mine, all);
    unsigned s = 0;
    for (int i = 0; i < 32; ++i) s += all[i][0];
    return (int)s;
}

inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

// dp4a.u32.s32: a's bytes unsigned, b's signed.
inline int dp4a_us(unsigned a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(unsigned char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

// fp16 bits -> float, exactly (subnormals, infinities and NaN payloads kept), as cvt.f32.f16 does.
inline float hostsim_half_to_float(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    unsigned bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int e = 113;
        unsigned m = man;
        while (!(m & 0x400)) m <<= 1, --e;
        bits = sign | ((unsigned)e << 23) | ((m & 0x3FF) << 13);
    }
    return __uint_as_float(bits);
}
