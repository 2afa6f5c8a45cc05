// Shared device helpers for the cusparseattn kernels: element types, tile loads, tensor-core MMAs, the online
// softmax and the token mask of partial tiles. NVRTC-clean: no host headers.
//
// The builder prepends a prelude that defines, before this header is included:
//   CSA_DTYPE_BF16 (0/1), HEAD_DIM (padded to 16), HEAD_DIM_REAL, TILE_M, TILE_N, NWARPS,
//   RULE_MODE (RULE_NONE / RULE_EXPR / RULE_BITS) and, for RULE_EXPR, CSA_RULE(b, h, q, k).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <math.h>: +inf as a bit pattern.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define RULE_NONE 0
#define RULE_EXPR 1
#define RULE_BITS 2

namespace csa {

#if CSA_DTYPE_BF16
using elem_t = __nv_bfloat16;
using elem2_t = __nv_bfloat162;
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2bfloat162_rn(a, b); }
#define CSA_MMA_TYPES "bf16.bf16"
#else
using elem_t = __half;
using elem2_t = __half2;
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2half2_rn(a, b); }
#define CSA_MMA_TYPES "f16.f16"
#endif

// log2(e): scores are scaled by scale * LOG2E once so that exp(x) becomes exp2 of an FMA result.
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Kernel parameters, passed by value. Strides are in elements; 64-bit so that B*H*S*D may exceed 2^31.
// The builder mirrors this struct field by field in a NumPy structured dtype (cusparseattn/build.py).
struct Params {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* lse;
    long long q_sb, q_sh, q_ss;
    long long k_sb, k_sh, k_ss;
    long long v_sb, v_sh, v_ss;
    long long o_sb, o_sh, o_ss;
    long long lse_sb, lse_sh;
    int seq_q, seq_k, heads_q, group;   // group = Hq / Hkv
    int layout_batch, layout_heads;      // 1 (shared) or B / Hq
    int tiles_q;
    int sub_q_shift, sub_k_shift, sub_k_count;  // layout blocks inside a kernel tile (log2 sizes, count per row)
    float scale;                                // softmax scale (of q . k)
    const int* row_ptr;                         // [layout_batch * layout_heads * tiles_q + 1]
    const int2* entries;                        // (key tile, partial index or -1)
    const ulonglong2* sub_bits;                 // per partial entry: layout blocks of the tile that are set (x)
                                                // and that are partial (y), one bit each, row-major
    const unsigned long long* bit_mask;         // RULE_BITS: per partial entry, TILE_M rows of TILE_N bits
    long long rule_p[8];                        // P0..P7 of the token rule
    const int* rule_a[4];                       // A0..A3 of the token rule
};

// ---- memory -----------------------------------------------------------------------------------------------
// 16-byte asynchronous global->shared copy; src_bytes = 0 zero-fills (rows past the sequence, padded columns).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Shared rows are padded by 16 bytes: for HEAD_DIM a multiple of 16 the 8 row addresses of an ldmatrix
// then fall in distinct banks, without a swizzle.
constexpr int SMEM_ROW = HEAD_DIM + 8;

// Copies rows [row0, row0 + ROWS) of one head (row stride `ss` elements) into shared memory; rows at or past
// `rows_valid` and columns past HEAD_DIM_REAL are zero-filled so that padded lanes contribute nothing.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(elem_t* smem, const elem_t* g, long long ss, int row0,
                                                int rows_valid) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        int r = i / CHUNKS, c = i % CHUNKS;
        bool ok = (row0 + r < rows_valid) && (c * 8 < HEAD_DIM_REAL);
        const elem_t* src = ok ? g + (long long)(row0 + r) * ss + c * 8 : g;
        cp_async16(smem + r * SMEM_ROW + c * 8, src, ok ? 16 : 0);
    }
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

// ---- tensor cores: D += A(16x16) * B(16x8), fp32 accumulators -----------------------------------------
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." CSA_MMA_TYPES ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_u32(float a, float b) {
    elem2_t v = pack2(a, b);
    return *reinterpret_cast<unsigned*>(&v);
}

// A warp's 16 query rows as A fragments, one per 16-wide slice of the head dimension. Up to HEAD_DIM 128 they
// live in registers for the whole key walk; past that they would leave too few registers for the output
// accumulators, so they stay in shared memory and are loaded per slice.
#define Q_IN_REGS (HEAD_DIM <= 128)
struct QFrag {
#if Q_IN_REGS
    unsigned a[HEAD_DIM / 16][4];
#else
    const elem_t* base;
#endif

    // q_smem points at the warp's first row. Lanes 0-15 address rows 0-15 at column 0, lanes 16-31 at column 8.
    __device__ __forceinline__ void load(const elem_t* q_smem, int lane) {
        const elem_t* p = q_smem + (lane & 15) * SMEM_ROW + (lane >> 4) * 8;
#if Q_IN_REGS
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) ldmatrix_x4(a[kk], p + kk * 16);
#else
        base = p;
#endif
    }

    __device__ __forceinline__ void get(unsigned (&r)[4], int kk) const {
#if Q_IN_REGS
        r[0] = a[kk][0], r[1] = a[kk][1], r[2] = a[kk][2], r[3] = a[kk][3];
#else
        ldmatrix_x4(r, base + kk * 16);
#endif
    }
};

// s[n] (16 x 8 each, TILE_N / 8 of them) = Q(16 x D) K^T for the warp's rows and the tile's TILE_N keys.
__device__ __forceinline__ void mma_QKt(float (&s)[TILE_N / 8][4], const QFrag& q, const elem_t* k_smem,
                                        int lane) {
#pragma unroll
    for (int n = 0; n < TILE_N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    // ldmatrix x4 over K: matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15)
    const elem_t* base = k_smem + ((lane & 7) + ((lane >> 4) << 3)) * SMEM_ROW + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        unsigned a[4];
        q.get(a, kk);
#pragma unroll
        for (int n = 0; n < TILE_N / 8; n += 2) {
            unsigned b[4];
            ldmatrix_x4(b, base + n * 8 * SMEM_ROW + kk * 16);
            mma_16816(s[n], a, b[0], b[1]);
            mma_16816(s[n + 1], a, b[2], b[3]);
        }
    }
}

// o[d] (16 x 8 each, HEAD_DIM / 8 of them) += P(16 x TILE_N) V(TILE_N x D). P comes straight from the score
// accumulators: the C layout of two adjacent n-tiles is the A layout of one k-step.
__device__ __forceinline__ void mma_PV(float (&o)[HEAD_DIM / 8][4], const float (&p)[TILE_N / 8][4],
                                       const elem_t* v_smem, int lane) {
    // ldmatrix x4 trans over V: matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15)
    const elem_t* base = v_smem + ((lane & 7) + (((lane >> 3) & 1) << 3)) * SMEM_ROW + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < TILE_N / 16; ++kk) {
        unsigned a[4] = {pack_u32(p[2 * kk][0], p[2 * kk][1]), pack_u32(p[2 * kk][2], p[2 * kk][3]),
                         pack_u32(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_u32(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; d += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, base + kk * 16 * SMEM_ROW + d * 8);
            mma_16816(o[d], a, b[0], b[1]);
            mma_16816(o[d + 1], a, b[2], b[3]);
        }
    }
}

// ---- online softmax over the two rows a thread holds (g and g + 8 of the warp's 16) ------------------------
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

struct OnlineSoftmax {
    float m[2];  // running max of the scaled scores, in log2 units
    float l[2];  // this thread's part of the running sum (reduced across the quad at the end)

    __device__ __forceinline__ void init() {
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
    }

    // Turns raw scores into probabilities in place and rescales the output accumulators to the new max.
    __device__ __forceinline__ void update(float (&s)[TILE_N / 8][4], float (&o)[HEAD_DIM / 8][4],
                                           float scale) {
        const float scale_log2 = scale * LOG2E;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int n = 0; n < TILE_N / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]) * scale_log2);
            mx = quad_max(mx);
            // A row with nothing visible so far keeps max -inf; subtract 0 instead, never -inf - -inf.
            float base = mx == -INFINITY ? 0.f : mx;
            float alpha = exp2f(m[r] - base);
            m[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < TILE_N / 8; ++n) {
                // fmaf(s, scale, -base): the scale folds into the exponent's FMA.
                s[n][2 * r] = exp2f(fmaf(s[n][2 * r], scale_log2, -base));
                s[n][2 * r + 1] = exp2f(fmaf(s[n][2 * r + 1], scale_log2, -base));
                sum += s[n][2 * r] + s[n][2 * r + 1];
            }
            l[r] = l[r] * alpha + sum;
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 8; ++d) {
                o[d][2 * r] *= alpha;
                o[d][2 * r + 1] *= alpha;
            }
        }
    }
};

// ---- token mask of a partial tile ---------------------------------------------------------------------------
// Masked scores become -inf, so exp2 gives exactly 0. `row0` is the warp's first row inside the tile; the
// mask is evaluated at absolute token indices (q_tile0 + row, k_tile0 + col).
__device__ __forceinline__ void apply_mask(float (&s)[TILE_N / 8][4], const Params& p, int pidx, int b, int h,
                                           int q_tile0, int k_tile0, int row0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#if RULE_MODE == RULE_BITS
    // The host folded layout blocks, the rule and the sequence end into one bit per token pair.
    constexpr int WORDS = (TILE_N + 63) / 64;
    const unsigned long long* bits = p.bit_mask + (long long)pidx * TILE_M * WORDS;
#else
    const ulonglong2 sub = p.sub_bits[pidx];
#endif
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r;
#if RULE_MODE == RULE_BITS
        unsigned long long word[WORDS];
#pragma unroll
        for (int w = 0; w < WORDS; ++w) word[w] = bits[row * WORDS + w];
#endif
#pragma unroll
        for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = n * 8 + 2 * t + c;
#if RULE_MODE == RULE_BITS
                const bool ok = (word[col >> 6] >> (col & 63)) & 1ull;
#else
                const int kc = k_tile0 + col;
                const int bit = (row >> p.sub_q_shift) * p.sub_k_count + (col >> p.sub_k_shift);
                bool ok = kc < p.seq_k && ((sub.x >> bit) & 1ull);
#if RULE_MODE == RULE_EXPR
                // The rule decides only inside partial blocks; full blocks of the same tile attend whole.
                ok = ok && (!((sub.y >> bit) & 1ull) ||
                            CSA_RULE((long long)b, (long long)h, (long long)(q_tile0 + row), (long long)kc));
#endif
#endif
                if (!ok) s[n][2 * r + c] = -INFINITY;
            }
        }
    }
}

}  // namespace csa
