// Shared device helpers for the cusparseattn kernels: element types, the parameters (params.cuh), tile
// loads, the copy pipeline, tensor-core MMAs and the forward's online softmax. NVRTC-clean: no host headers.
// The masks of partial tiles and the score mods (masking.cuh) and the backward's helpers (backward.cuh)
// follow it.
//
// The builder prepends a prelude that defines, before this header is included:
//   CSA_DTYPE_BF16 (0/1), CSA_DTYPE_F32 (0/1: float32 on TF32 tensor cores) and, for float32, CSA_TF32X3 (0/1:
//   precision "highest", split TF32), HEAD_DIM (padded to 16), HEAD_DIM_REAL, TILE_M (query tile), TILE_N (key tile),
//   NWARPS, SHARED_BYTES (the dynamic shared memory it launches with), RULE_MODE (RULE_NONE / RULE_EXPR /
//   RULE_BITS) and, for RULE_EXPR, CSA_RULE(b, h, q, k) and RULE_BAND (0/1), for 1 CSA_RULE_FIRST(b, h, q)
//   and/or CSA_RULE_LAST(b, h, q) (analyses.band: the rule is FIRST <= k <= LAST), and RULE_QBAND (0/1),
//   for 1 CSA_RULE_QFIRST(b, h, k) and/or CSA_RULE_QLAST(b, h, k) (the band of q: QFIRST <= q <= QLAST);
//   SCORE_MOD (0/1) and, for 1, CSA_SCORE(s, b, h, q, k) and its derivative in s, CSA_SCORE_GRAD(s, b, h, q, k).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "rule.cuh"

// NVRTC has no <math.h>: +inf as a bit pattern.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define RULE_NONE 0
#define RULE_EXPR 1
#define RULE_BITS 2

namespace csa {

#if CSA_DTYPE_F32
using elem_t = float;
using elem2_t = float2;
__device__ __forceinline__ elem2_t pack2(float a, float b) { return make_float2(a, b); }
__device__ __forceinline__ float2 unpack2(elem2_t x) { return x; }
#elif CSA_DTYPE_BF16
using elem_t = __nv_bfloat16;
using elem2_t = __nv_bfloat162;
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ float2 unpack2(elem2_t x) { return __bfloat1622float2(x); }
#define CSA_MMA_TYPES "bf16.bf16"
#else
using elem_t = __half;
using elem2_t = __half2;
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float2 unpack2(elem2_t x) { return __half22float2(x); }
#define CSA_MMA_TYPES "f16.f16"
#endif
#ifndef CSA_TF32X3
#define CSA_TF32X3 0
#endif
// The portable passes' launch bounds. float32's fragments take twice fp16's registers, and ptxas's own target
// at 128 threads (168 registers on sm_90) spills some of its passes: one block per SM lets it take what it needs.
#if CSA_DTYPE_F32
#define CSA_LAUNCH_BOUNDS __launch_bounds__(THREADS, 1)
#else
#define CSA_LAUNCH_BOUNDS __launch_bounds__(THREADS)
#endif

// log2(e): scores are scaled by scale * LOG2E once so that exp(x) becomes exp2 of an FMA result.
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

}  // namespace csa

#include "params.cuh"

namespace csa {

// ---- memory -----------------------------------------------------------------------------------------------
// Asynchronous global->shared copies; src_bytes = 0 zero-fills (rows past the sequence, padded columns).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Elements of a 16-byte chunk (a cp.async copy, a row of an ldmatrix matrix) and of an MMA's reduction step:
// 32 bytes of a row, k16 for fp16 / bf16 and k8 for TF32.
constexpr int CHUNK = 16 / sizeof(elem_t);
constexpr int MMA_K = 2 * CHUNK;
// A head's row of elements in bytes: what a warp's fragments of 16 rows take in registers (RowFrag).
constexpr int ROW_BYTES = HEAD_DIM * sizeof(elem_t);

// Shared rows are padded by 16 bytes: for HEAD_DIM a multiple of 16 the 8 row addresses of an ldmatrix
// then fall in distinct banks, without a swizzle, and so do the float32 B operands that mma_AB loads a word at
// a time (rows 2t and 2t + 1, columns g: rows two apart are 8 banks apart).
constexpr int SMEM_ROW = HEAD_DIM + CHUNK;

// Copies rows [row0, row0 + ROWS) of one head (row stride `ss` elements) into shared memory; rows at or past
// `rows_valid` and columns past HEAD_DIM_REAL are zero-filled so that padded lanes contribute nothing.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(elem_t* smem, const elem_t* g, long long ss, int row0,
                                                int rows_valid) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        int r = i / CHUNKS, c = i % CHUNKS;
        bool ok = (row0 + r < rows_valid) && (c * CHUNK < HEAD_DIM_REAL);
        const elem_t* src = ok ? g + (long long)(row0 + r) * ss + c * CHUNK : g;
        cp_async16(smem + r * SMEM_ROW + c * CHUNK, src, ok ? 16 : 0);
    }
}

// Copies the K and V rows [k0, k0 + ROWS) of one head into shared memory: K at `kv`, V right after it.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_kv_async(elem_t* kv, const elem_t* k_head, const elem_t* v_head,
                                              const Params& p, int k0) {
    load_tile_async<ROWS, THREADS>(kv, k_head, p.k_ss, k0, p.seq_k);
    load_tile_async<ROWS, THREADS>(kv + ROWS * SMEM_ROW, v_head, p.v_ss, k0, p.seq_k);
}

// Copies ROWS floats of one head's row vector (lse, delta) starting at row0; entries past `rows_valid` are 0.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_vec_async(float* smem, const float* g, int row0, int rows_valid) {
    for (int i = threadIdx.x; i < ROWS; i += THREADS) {
        const bool ok = row0 + i < rows_valid;
        cp_async4(smem + i, ok ? g + row0 + i : g, ok ? 4 : 0);
    }
}

// Walks `count` jobs through two shared-memory stages: while job i is computed from one stage, the copies of
// job i + 1 fill the other. load(stage, i) issues job i's copies; compute(stage, i) consumes them. Copies a
// caller issued before the walk (a resident tile) complete with job 0's.
template <class Load, class Compute>
__device__ __forceinline__ void pipeline2(int count, Load&& load, Compute&& compute) {
    if (count <= 0) return;
    load(0, 0);
    cp_async_commit();
    for (int i = 0; i < count; ++i) {
        if (i + 1 < count) {
            load((i + 1) & 1, i + 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        compute(i & 1, i);
        // The next job's copies overwrite the stage this one read.
        __syncthreads();
    }
}

__device__ __forceinline__ unsigned dynamic_smem_size() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const elem_t* p) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const elem_t* p) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// ---- tensor cores: D += A(16 x MMA_K) * B(MMA_K x 8), fp32 accumulators -----------------------------------
// mma takes the registers as loaded (ldmatrix, or accumulators packed): for fp16 / bf16 they go to the tensor
// cores as they are; for float32, `operand` gives A's TF32 rounding to nearest (cvt.rna, as cuBLAS rounds) once
// per k-step, and mma rounds B's, and for CSA_TF32X3 each also carries the TF32 rounding of what that left out,
// so that big * big + big * small + small * big carries a float32 product to float32's rounding (split TF32;
// small * small lies below it).
#if CSA_DTYPE_F32
template <int N>
struct Operand {
    unsigned big[N];
#if CSA_TF32X3
    unsigned small[N];
#endif
};

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
// Operands from float32 values given by their bits (as shared-memory loads give them).
template <int N>
__device__ __forceinline__ Operand<N> operand(const unsigned (&bits)[N]) {
    Operand<N> r;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float x = __uint_as_float(bits[i]);
        r.big[i] = to_tf32(x);
#if CSA_TF32X3
        r.small[i] = to_tf32(x - __uint_as_float(r.big[i]));
#endif
    }
    return r;
}

__device__ __forceinline__ void mma_1688(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma(float (&d)[4], const Operand<4>& a, unsigned b0, unsigned b1) {
    const Operand<2> b = operand<2>({b0, b1});
#if CSA_TF32X3
    // The small products first, while d is small, so that they are not lost beside the big one.
    mma_1688(d, a.small, b.big);
    mma_1688(d, a.big, b.small);
#endif
    mma_1688(d, a.big, b.big);
}
#else
template <int N>
__device__ __forceinline__ const unsigned (&operand(const unsigned (&bits)[N]))[N] {
    return bits;
}

__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." CSA_MMA_TYPES ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_u32(float a, float b) {
    elem2_t v = pack2(a, b);
    return *reinterpret_cast<unsigned*>(&v);
}
#endif

template <int N>
__device__ __forceinline__ void zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// A warp's 16 rows of a [rows x HEAD_DIM] shared tile (Q in the forward; Q and dO, or K and V, in the
// backward) as A fragments, one per MMA_K-wide slice of the head dimension. IN_REGS keeps them in registers for
// the whole walk; otherwise they stay in shared memory and are loaded per slice, which leaves the registers to
// the accumulators. ldmatrix moves 16-bit pairs, so it serves float32 too: its 8 x 8 b16 matrices are 8 x 4
// floats, thread (g, t) getting row g's float t, the TF32 A layout.
template <bool IN_REGS>
struct RowFrag {
    unsigned a[IN_REGS ? HEAD_DIM / MMA_K : 1][4];
    const elem_t* base;

    // rows points at the warp's first row. Lanes 0-15 address rows 0-15 at column 0, lanes 16-31 at the
    // second 16-byte chunk.
    __device__ __forceinline__ void load(const elem_t* rows, int lane) {
        base = rows + (lane & 15) * SMEM_ROW + (lane >> 4) * CHUNK;
        if constexpr (IN_REGS) {
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / MMA_K; ++kk) ldmatrix_x4(a[kk], base + kk * MMA_K);
        }
    }

    __device__ __forceinline__ void get(unsigned (&r)[4], int kk) const {
        if constexpr (IN_REGS) {
            r[0] = a[kk][0], r[1] = a[kk][1], r[2] = a[kk][2], r[3] = a[kk][3];
        } else {
            ldmatrix_x4(r, base + kk * MMA_K);
        }
    }
};

// s[n] (16 x 8 each, N / 8 of them) = A(16 x D) B^T for the warp's 16 rows of A and the N rows of the shared
// tile b_smem ([N x HEAD_DIM]): Q K^T in the forward, also dO V^T, K Q^T and V dO^T in the backward.
template <int N, class Frag>
__device__ __forceinline__ void mma_ABt(float (&s)[N / 8][4], const Frag& a_frag, const elem_t* b_smem,
                                        int lane) {
    zero(s);
    // ldmatrix x4 over B: matrices (rows 0-7, chunk 0), (rows 0-7, chunk 1), (rows 8-15, chunk 0), (rows 8-15,
    // chunk 1): the B operands of two n-tiles
    const elem_t* base = b_smem + ((lane & 7) + ((lane >> 4) << 3)) * SMEM_ROW + ((lane >> 3) & 1) * CHUNK;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / MMA_K; ++kk) {
        unsigned r[4];
        a_frag.get(r, kk);
        const auto& a = operand(r);
#pragma unroll
        for (int n = 0; n < N; n += 16) {
            unsigned b[4];
            ldmatrix_x4(b, base + n * SMEM_ROW + kk * MMA_K);
            mma(s[n / 8], a, b[0], b[1]);
            mma(s[n / 8 + 1], a, b[2], b[3]);
        }
    }
}

// o[d] (16 x 8 each, DW / 8 of them) += P(16 x K) B(K x DW): P from score-shaped accumulators, B the first K
// rows of a shared tile from column b_smem's, DW columns wide. P V in the forward; P^T dO, dS^T Q and dS K in
// the backward.
// fp16 / bf16: the C layout of two adjacent n-tiles is the A layout of one k-step, and ldmatrix x4 trans over B
// gives matrices (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15).
// float32: a TF32 A operand holds columns t and t + 4 where the accumulator holds 2t and 2t + 1; the product sums
// over k in any order, so k-step kk takes n-tile kk's accumulators as they lie (its k = t is column 2t, k = t + 4
// column 2t + 1) and B's rows in the same order, 2t and 2t + 1: single words (ldmatrix cannot transpose 32-bit
// elements), rows two apart 8 banks apart (SMEM_ROW).
// FRESH (split TF32, CSA_TF32X3): the tensor cores add into an fp32 accumulator without rounding to nearest, an
// error that grows with each add into an accumulator grown large; O and dQ sum over every key, dK and dV over
// every query, past float32's rounding. So the products of one call go, an n-tile at a time, to a fresh
// accumulator that a rounded FADD adds to o, A's operands formed again for each n-tile: registers that
// float32's tiles at "highest" leave free (tuning.HIGHEST_TILES).
template <int K, int DW, bool FRESH = false>
__device__ __forceinline__ void mma_AB(float (&o)[DW / 8][4], const float (&p)[K / 8][4], const elem_t* b_smem,
                                       int lane) {
#if CSA_DTYPE_F32
    const elem_t* base = b_smem + 2 * (lane & 3) * SMEM_ROW + (lane >> 2);
    const auto a_operand = [&](int kk) {
        return operand<4>({__float_as_uint(p[kk][0]), __float_as_uint(p[kk][2]), __float_as_uint(p[kk][1]),
                           __float_as_uint(p[kk][3])});
    };
#if CSA_TF32X3
    if constexpr (FRESH) {
#pragma unroll
        for (int d = 0; d < DW / 8; ++d) {
            float part[4] = {};
#pragma unroll
            for (int kk = 0; kk < K / MMA_K; ++kk) {
                const elem_t* at = base + kk * MMA_K * SMEM_ROW + d * 8;
                mma(part, a_operand(kk), __float_as_uint(at[0]), __float_as_uint(at[SMEM_ROW]));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) o[d][j] += part[j];
        }
        return;
    }
#endif
#pragma unroll
    for (int kk = 0; kk < K / MMA_K; ++kk) {
        const Operand<4> a = a_operand(kk);
#pragma unroll
        for (int d = 0; d < DW / 8; d += 2) {
            const elem_t* at = base + kk * MMA_K * SMEM_ROW + d * 8;
            const unsigned b[4] = {__float_as_uint(at[0]), __float_as_uint(at[SMEM_ROW]), __float_as_uint(at[8]),
                                   __float_as_uint(at[SMEM_ROW + 8])};
            mma(o[d], a, b[0], b[1]);
            mma(o[d + 1], a, b[2], b[3]);
        }
    }
#else
    const elem_t* base = b_smem + ((lane & 7) + (((lane >> 3) & 1) << 3)) * SMEM_ROW + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < K / MMA_K; ++kk) {
        unsigned a[4] = {pack_u32(p[2 * kk][0], p[2 * kk][1]), pack_u32(p[2 * kk][2], p[2 * kk][3]),
                         pack_u32(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_u32(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int d = 0; d < DW / 8; d += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, base + kk * MMA_K * SMEM_ROW + d * 8);
            mma(o[d], a, b[0], b[1]);
            mma(o[d + 1], a, b[2], b[3]);
        }
    }
#endif
}

// Stores a warp's 16 x DW accumulator rows, each multiplied by its row's factor, as elements: rows at or past
// rows_valid and columns past HEAD_DIM_REAL are skipped. `row0` is the warp's first row, `col0` the first
// column of the slice.
template <int DW>
__device__ __forceinline__ void store_rows(const float (&acc)[DW / 8][4], const float (&factor)[2], elem_t* head,
                                           long long ss, int row0, int rows_valid, int col0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r;
        if (row >= rows_valid) continue;
        elem_t* dst = head + (long long)row * ss + col0;
#pragma unroll
        for (int d = 0; d < DW / 8; ++d) {
            const int col = d * 8 + 2 * t;
            if (col0 + col < HEAD_DIM_REAL)
                *reinterpret_cast<elem2_t*>(dst + col) =
                    pack2(acc[d][2 * r] * factor[r], acc[d][2 * r + 1] * factor[r]);
        }
    }
}

// ---- reductions over lanes ---------------------------------------------------------------------------------
// Over each LANES consecutive lanes (a power of two), the result in every one of them: a quad (4) holds one row
// of an MMA accumulator, a warp (32) the combine pass's parts of a row.
template <int LANES>
__device__ __forceinline__ float lanes_max(float x) {
#pragma unroll
    for (int i = 1; i < LANES; i *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, i));
    return x;
}
template <int LANES>
__device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
    for (int i = 1; i < LANES; i *= 2) x += __shfl_xor_sync(0xffffffffu, x, i);
    return x;
}

// ---- the forward's online softmax ---------------------------------------------------------------------
// The online softmax over the two rows a thread holds (g and g + 8 of the warp's 16): the same for the
// mma.sync and the wgmma kernels, whose accumulators a warp holds alike.
struct OnlineSoftmax {
    float m[2];  // running max of the scaled scores, in log2 units
    float l[2];  // this thread's part of the running sum (reduced across the quad at the end)

    __device__ __forceinline__ void init() {
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
    }

    // Turns raw scores into probabilities in place; alpha[r] is the factor that brings row r's earlier
    // output to the new max. The row's max is that of its raw scores, scaled once (the kernels take a positive
    // scale: cuda.reasons), or with `scaled_max` the max of scores scaled a pair at a time: TILE_N / 4 more
    // FMULs, which suit the Hopper forward's narrow tiles at head dim 64 (tuning.forward_scaled_max).
    // With `lagging`, a row keeps its max until a tile's passes it by more than 2^MAX_LAG (FlashAttention-4's
    // rescale threshold): alpha is then exactly 1, so that most steps rescale nothing, and the probabilities
    // reach 2^MAX_LAG, which float32 sums and bf16 / fp16 hold to the same relative precision.
    static constexpr float MAX_LAG = 8.f;
    template <bool scaled_max = false, bool lagging = false>
    __device__ __forceinline__ void step(float (&s)[TILE_N / 8][4], float scale, float (&alpha)[2]) {
        const float scale_log2 = scale * LOG2E;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = scaled_max ? m[r] : -INFINITY;
#pragma unroll
            for (int n = 0; n < TILE_N / 8; ++n) {
                const float pair = fmaxf(s[n][2 * r], s[n][2 * r + 1]);
                mx = fmaxf(mx, scaled_max ? pair * scale_log2 : pair);
            }
            mx = scaled_max ? lanes_max<4>(mx) : fmaxf(m[r], lanes_max<4>(mx) * scale_log2);
            // While m is -inf the difference is inf or NaN, never <= MAX_LAG: a row's first visible keys set it.
            if (lagging && mx - m[r] <= MAX_LAG) mx = m[r];
            // A row with nothing visible so far keeps max -inf; subtract 0 instead, never -inf - -inf.
            float base = mx == -INFINITY ? 0.f : mx;
            alpha[r] = exp2f(m[r] - base);
            m[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < TILE_N / 8; ++n) {
                // fmaf(s, scale, -base): the scale folds into the exponent's FMA.
                s[n][2 * r] = exp2f(fmaf(s[n][2 * r], scale_log2, -base));
                s[n][2 * r + 1] = exp2f(fmaf(s[n][2 * r + 1], scale_log2, -base));
                sum += s[n][2 * r] + s[n][2 * r + 1];
            }
            l[r] = l[r] * alpha[r] + sum;
        }
    }

    __device__ __forceinline__ static void rescale(float (&o)[HEAD_DIM / 8][4], const float (&alpha)[2]) {
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d) {
            o[d][0] *= alpha[0];
            o[d][1] *= alpha[0];
            o[d][2] *= alpha[1];
            o[d][3] *= alpha[1];
        }
    }

    // Both at once, where the output is not in flight.
    __device__ __forceinline__ void update(float (&s)[TILE_N / 8][4], float (&o)[HEAD_DIM / 8][4],
                                           float scale) {
        float alpha[2];
        step(s, scale, alpha);
        rescale(o, alpha);
    }
};

// A row's log-sum-exp from its max `m` (log2 units) and sum `l`: -inf where no key was visible.
__device__ __forceinline__ float lse_of(float m, float l) { return l > 0.f ? m * LN2 + logf(l) : -INFINITY; }

// The forward's statistics for a warp's 16 rows from `row0`: writes lse = m * ln2 + ln(l) (-inf where a row
// saw nothing) and returns in `inv` the factors 1 / l (0 there) that normalise the thread's two rows of out.
__device__ __forceinline__ void finish_lse(const Params& p, const OnlineSoftmax& sm, int b, int h, int row0,
                                           int lane, float (&inv)[2]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = lanes_sum<4>(sm.l[r]);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int q = row0 + g + 8 * r;
        if (t == 0 && q < p.seq_q) p.lse[b * p.lse_sb + h * p.lse_sh + q] = lse_of(sm.m[r], l);
    }
}

// A split row's part (schedule.work_order) in its slot of the scratch (p.stats): TILE_M lse, then out = acc / l,
// [TILE_M][HEAD_DIM] fp32, for the combine pass (forward_combine.cu). `row0`: the warp's first row in the tile.
constexpr int PART_SLOT = TILE_M * (HEAD_DIM + 1);
__device__ __forceinline__ void store_part(const Params& p, const OnlineSoftmax& sm, const float (&o)[HEAD_DIM / 8][4],
                                           int part, int row0, int lane) {
    float* slot = p.stats + (long long)part * PART_SLOT;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = lanes_sum<4>(sm.l[r]), inv = l > 0.f ? 1.f / l : 0.f;
        const int row = row0 + g + 8 * r;
        if (t == 0) slot[row] = lse_of(sm.m[r], l);
        float* out = slot + TILE_M + row * HEAD_DIM + 2 * t;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d)
            *reinterpret_cast<float2*>(out + d * 8) = make_float2(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
    }
}

// The forward's end for a warp's 16 rows from `row0`: lse (finish_lse) and out = acc / l.
__device__ __forceinline__ void finish_rows(const Params& p, const OnlineSoftmax& sm, float (&o)[HEAD_DIM / 8][4],
                                            int b, int h, int row0, int lane) {
    float inv[2];
    finish_lse(p, sm, b, h, row0, lane, inv);
    store_rows<HEAD_DIM>(o, inv, p.o + b * p.o_sb + h * p.o_sh, p.o_ss, row0, p.seq_q, 0, lane);
}

}  // namespace csa

#include "masking.cuh"
#include "backward.cuh"
