// Shared device helpers for the cusparseattn kernels: element types, tile loads, the copy pipeline, tensor-core
// MMAs and the token mask of partial tiles. NVRTC-clean: no host headers.
//
// The builder prepends a prelude that defines, before this header is included:
//   CSA_DTYPE_BF16 (0/1), HEAD_DIM (padded to 16), HEAD_DIM_REAL, TILE_M (query tile), TILE_N (key tile),
//   NWARPS, SHARED_BYTES (the dynamic shared memory it launches with), RULE_MODE (RULE_NONE / RULE_EXPR /
//   RULE_BITS) and, for RULE_EXPR, CSA_RULE(b, h, q, k) and RULE_BAND (0/1), for 1 CSA_RULE_FIRST(b, h, q)
//   and/or CSA_RULE_LAST(b, h, q) (rules.key_band: the rule is FIRST <= k <= LAST), and RULE_QBAND (0/1),
//   for 1 CSA_RULE_QFIRST(b, h, k) and/or CSA_RULE_QLAST(b, h, k) (rules.query_band: QFIRST <= q <= QLAST);
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

#if CSA_DTYPE_BF16
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

// log2(e): scores are scaled by scale * LOG2E once so that exp(x) becomes exp2 of an FMA result.
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Kernel parameters of every pass, passed by value. Strides are in elements; 64-bit so that B*H*S*D may exceed
// 2^31. The builder mirrors this struct field by field in a NumPy structured dtype (cusparseattn/build.py).
struct Params {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* lse;
    const elem_t* dout;  // the backward's inputs and outputs (null in the forward)
    elem_t* dq;
    elem_t* dk;
    elem_t* dv;
    float* stats;        // [B, Hq, 2 (+ HEAD_DIM + 1), padded Sq]: per query row lse * log2(e) and delta =
                         // rowsum(dout * out) (STAT_LSE2, STAT_DELTA), written by the dQ pass (or the
                         // statistics pass), read by the dK/dV pass; the fused backward's dQ sums after them
    long long q_sb, q_sh, q_ss;
    long long k_sb, k_sh, k_ss;
    long long v_sb, v_sh, v_ss;
    long long o_sb, o_sh, o_ss;
    long long do_sb, do_sh, do_ss;
    long long dq_sb, dq_sh, dq_ss;
    long long dk_sb, dk_sh, dk_ss;
    long long dv_sb, dv_sh, dv_ss;
    long long lse_sb, lse_sh;
    long long stats_sb, stats_sh, stats_sr;  // stats_sr: from one statistic to the next, the padded length
    int seq_q, seq_k, heads_q, group;   // group = Hq / Hkv
    int layout_batch, layout_heads;      // 1 (shared) or B / Hq
    int tiles_q, tiles_k;
    int sub_q_shift, sub_k_shift, sub_k_count;  // layout blocks inside a kernel tile (log2 sizes, count per row)
    float scale;                                // softmax scale (of q . k)
    const int* row_ptr;                         // [layout_batch * layout_heads * tiles_q + 1]
    const int2* entries;                        // (key tile, partial index or -1)
    const int* col_ptr;                         // [layout_batch * layout_heads * tiles_k + 1]
    const int2* col_entries;                    // (query tile, partial index or -1)
    const ulonglong2* sub_bits;                 // per partial entry: layout blocks of the tile that are set (x)
                                                // and that are partial (y), one bit each, row-major
    const unsigned long long* bit_mask;         // RULE_BITS: per partial entry, TILE_M rows of TILE_N bits
    long long rule_p[8];                        // P0..P7 of the token rule
    const int* rule_a[4];                       // A0..A3 of the token rule
    long long q_origin, k_origin;               // global positions of query and key 0, for score mods
    long long score_ip[8];                      // SI0..SI7 of the score mod
    float score_fp[8];                          // SF0..SF7
    const void* score_a[4];                     // SA0..SA3 (the expression casts them to their element type)
    const int* work;                            // persistent passes: (batch, head, tile) items, heaviest first
    int work_count;
    int rule_narrow;                            // RULE_EXPR: evaluate the rule in int (cuda.py: rule_narrow)
    const int* col_start;                       // fused backward (schedule.column_schedule): per call column
    const long long* rank_ptr;                  // its first rank
    const int* ranks;                           // each visit's rank among its query tile's adds
    int dq_unordered;                           // fused backward: its dQ adds in any order (cuda.py)
    const int* parts;      // Hopper forward: each part of a split row: b, h, first query, first and end entry
    const int* split_ptr;  // its combine pass: split row s's parts are split_ptr[s] to split_ptr[s + 1]
};

// The layout's (batch, head) line for batch b, query head h: a shared layout has one line for all of them.
__device__ __forceinline__ int layout_line(const Params& p, int b, int h) {
    return (p.layout_batch > 1 ? b : 0) * p.layout_heads + (p.layout_heads > 1 ? h : 0);
}

// A span of the tile table's entries: the key tiles of one query tile's row (row_ptr / entries), or the query
// tiles of one key tile's column (col_ptr / col_entries), for batch b and query head h.
struct Span {
    int begin, count;
};
__device__ __forceinline__ Span row_span(const Params& p, int b, int h, int tile_q) {
    const int line = layout_line(p, b, h) * p.tiles_q + tile_q;
    return {p.row_ptr[line], p.row_ptr[line + 1] - p.row_ptr[line]};
}
__device__ __forceinline__ Span column_span(const Params& p, int b, int h, int tile_k) {
    const int line = layout_line(p, b, h) * p.tiles_k + tile_k;
    return {p.col_ptr[line], p.col_ptr[line + 1] - p.col_ptr[line]};
}

// SPLIT_ROWS: the Hopper forward's deal splits rows (build.KernelSpec.split_rows); the other passes walk none.
#ifndef SPLIT_ROWS
#define SPLIT_ROWS 0
#endif

// A persistent pass's work item with its row of the layout: batch element, query head, first query and the
// row's span of entries (a part of a split row: its part of them).
struct Row {
    int b, h, q0, begin, end;  // end, not a count: taking a row does no arithmetic on loads still in flight
    int part;                  // of a split row (schedule.work_order; its slot of the scratch), or -1
};

// A persistent CTA's work items: entries blockIdx.x, blockIdx.x + gridDim.x, ... of the work list (cuda.py:
// item = (b * heads_q + h) * tiles_q + tile, or -2 - p for part p of a split row), up to a -1. Read ahead:
// when one starts, the next one's row and the item after it are already loaded, so no item waits on a global
// load to begin.
struct Walk {
    int w, ahead;  // ahead: the item at w + gridDim.x, -1 past the last
    Row next;      // the item at w; b = -1 past the last

    __device__ __forceinline__ static int item_at(const Params& p, int w) {
        return w < p.work_count ? p.work[w] : -1;
    }
    __device__ __forceinline__ static Row row_of(const Params& p, int item) {
        if (SPLIT_ROWS ? item == -1 : item < 0) return {-1, 0, 0, 0, 0, -1};
        if (item < 0) {
            const int* part = p.parts + 5 * (-2 - item);
            return {part[0], part[1], part[2], part[3], part[4], -2 - item};
        }
        const int tile = item % p.tiles_q, h = (item / p.tiles_q) % p.heads_q, b = item / (p.tiles_q * p.heads_q);
        const int line = layout_line(p, b, h) * p.tiles_q + tile;
        return {b, h, tile * TILE_M, p.row_ptr[line], p.row_ptr[line + 1], -1};
    }
    __device__ __forceinline__ explicit Walk(const Params& p)
        : w(blockIdx.x), ahead(item_at(p, blockIdx.x + gridDim.x)), next(row_of(p, item_at(p, blockIdx.x))) {}
    __device__ __forceinline__ bool done() const { return next.b < 0; }
    __device__ __forceinline__ Row take(const Params& p) {
        const Row row = next;
        next = row_of(p, ahead);
        w += gridDim.x;
        ahead = item_at(p, w + gridDim.x);
        return row;
    }
};

// The query tile of a CTA of the row-walking passes (grid: query tiles, query heads, batch elements): the
// heaviest rows of causal-like layouts are the last ones, so they start first.
__device__ __forceinline__ int query_tile(const Params& p) { return p.tiles_q - 1 - blockIdx.x; }

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

template <int N>
__device__ __forceinline__ void zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// A warp's 16 rows of a [rows x HEAD_DIM] shared tile (Q in the forward; Q and dO, or K and V, in the
// backward) as A fragments, one per 16-wide slice of the head dimension. IN_REGS keeps them in registers for
// the whole walk; otherwise they stay in shared memory and are loaded per slice, which leaves the registers to
// the accumulators.
template <bool IN_REGS>
struct RowFrag {
    unsigned a[IN_REGS ? HEAD_DIM / 16 : 1][4];
    const elem_t* base;

    // rows points at the warp's first row. Lanes 0-15 address rows 0-15 at column 0, lanes 16-31 at column 8.
    __device__ __forceinline__ void load(const elem_t* rows, int lane) {
        base = rows + (lane & 15) * SMEM_ROW + (lane >> 4) * 8;
        if constexpr (IN_REGS) {
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) ldmatrix_x4(a[kk], base + kk * 16);
        }
    }

    __device__ __forceinline__ void get(unsigned (&r)[4], int kk) const {
        if constexpr (IN_REGS) {
            r[0] = a[kk][0], r[1] = a[kk][1], r[2] = a[kk][2], r[3] = a[kk][3];
        } else {
            ldmatrix_x4(r, base + kk * 16);
        }
    }
};

// s[n] (16 x 8 each, N / 8 of them) = A(16 x D) B^T for the warp's 16 rows of A and the N rows of the shared
// tile b_smem ([N x HEAD_DIM]): Q K^T in the forward, also dO V^T, K Q^T and V dO^T in the backward.
template <int N, class Frag>
__device__ __forceinline__ void mma_ABt(float (&s)[N / 8][4], const Frag& a_frag, const elem_t* b_smem,
                                        int lane) {
    zero(s);
    // ldmatrix x4 over B: matrices (rows 0-7, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 0-7), (rows 8-15, d 8-15)
    const elem_t* base = b_smem + ((lane & 7) + ((lane >> 4) << 3)) * SMEM_ROW + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        unsigned a[4];
        a_frag.get(a, kk);
#pragma unroll
        for (int n = 0; n < N; n += 16) {
            unsigned b[4];
            ldmatrix_x4(b, base + n * SMEM_ROW + kk * 16);
            mma_16816(s[n / 8], a, b[0], b[1]);
            mma_16816(s[n / 8 + 1], a, b[2], b[3]);
        }
    }
}

// o[d] (16 x 8 each, DW / 8 of them) += P(16 x K) B(K x DW): P from score-shaped accumulators (the C layout of
// two adjacent n-tiles is the A layout of one k-step), B the first K rows of a shared tile from column
// b_smem's, DW columns wide. P V in the forward; P^T dO, dS^T Q and dS K in the backward.
template <int K, int DW>
__device__ __forceinline__ void mma_AB(float (&o)[DW / 8][4], const float (&p)[K / 8][4], const elem_t* b_smem,
                                       int lane) {
    // ldmatrix x4 trans over B: matrices (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15)
    const elem_t* base = b_smem + ((lane & 7) + (((lane >> 3) & 1) << 3)) * SMEM_ROW + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned a[4] = {pack_u32(p[2 * kk][0], p[2 * kk][1]), pack_u32(p[2 * kk][2], p[2 * kk][3]),
                         pack_u32(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_u32(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int d = 0; d < DW / 8; d += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, base + kk * 16 * SMEM_ROW + d * 8);
            mma_16816(o[d], a, b[0], b[1]);
            mma_16816(o[d + 1], a, b[2], b[3]);
        }
    }
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

// ---- token mask of a partial tile ---------------------------------------------------------------------------
#if RULE_MODE == RULE_EXPR
// The rule at one token pair in RuleInt arithmetic (the builder's P0..P7 take that type too): long long, or
// int where the expression allows it (RULE_NARROWABLE: sums and comparisons) and the host found its values
// small enough to stay exact (Params::rule_narrow), which halves its instructions.
template <typename RuleInt>
__device__ __forceinline__ bool rule_at(const Params& p, int b, int h, int q, int k) {
    return CSA_RULE(static_cast<RuleInt>(b), static_cast<RuleInt>(h), static_cast<RuleInt>(q),
                    static_cast<RuleInt>(k));
}
#endif

// Whether query q0 + qi sees key k0 + ki, for tile-local (qi, ki) of the partial tile `pidx` whose sub-block
// bits are `sub` (ignored in RULE_BITS mode).
__device__ __forceinline__ bool visible(const Params& p, int pidx, const ulonglong2& sub, int b, int h, int q0,
                                        int k0, int qi, int ki) {
#if RULE_MODE == RULE_BITS
    // The host folded layout blocks, the rule and the sequence end into one bit per token pair.
    constexpr int WORDS = (TILE_N + 63) / 64;
    const unsigned long long word = p.bit_mask[((long long)pidx * TILE_M + qi) * WORDS + (ki >> 6)];
    return (word >> (ki & 63)) & 1ull;
#else
    const int kc = k0 + ki;
    const int bit = (qi >> p.sub_q_shift) * p.sub_k_count + (ki >> p.sub_k_shift);
    bool ok = kc < p.seq_k && ((sub.x >> bit) & 1ull);
#if RULE_MODE == RULE_EXPR
    // The rule decides only inside partial blocks; full blocks of the same tile attend whole.
    ok = ok && (!((sub.y >> bit) & 1ull) || rule_at<long long>(p, b, h, q0 + qi, kc));
#endif
    return ok;
#endif
}

// Calls f(n, j, row, col) for each element [n][j] of a warp's 16 x COLS accumulator tile, at tile-local row and
// column (rows from row0).
template <int COLS, class F>
__device__ __forceinline__ void for_each_element(int row0, int lane, F&& f) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < 2; ++c) f(n, 2 * r + c, row0 + g + 8 * r, n * 8 + 2 * t + c);
}

// One bit for each element of a warp's 16 x COLS accumulator tile: element [n][2r + c] (the thread's row r,
// column 8n + 2t + c) at bit 32r + 2(n % 16) + c of word n / 16, so that a word's halves are the thread's two
// rows of 128 columns in columns_before's order (band_bits). Unrolled loops index it with constants, so the
// words stay in registers.
template <int COLS>
struct ElementBits {
    unsigned long long word[(COLS + 127) / 128] = {};

    __device__ static constexpr int bit(int n, int j) { return 32 * (j >> 1) + 2 * (n % 16) + (j & 1); }
    __device__ __forceinline__ void set(int n, int j, bool on) {
        word[n / 16] |= (unsigned long long)on << bit(n, j);
    }
    __device__ __forceinline__ bool at(int n, int j) const { return (word[n / 16] >> bit(n, j)) & 1ull; }
};

// mask_bits's loop: visible_at(tile-local query, tile-local key) of each of the warp's elements.
template <bool TRANSPOSED, int COLS, class Visible>
__device__ __forceinline__ ElementBits<COLS> gather_bits(int row0, int lane, Visible visible_at) {
    ElementBits<COLS> bits;
    for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
        bits.set(n, j, TRANSPOSED ? visible_at(col, row) : visible_at(row, col));
    });
    return bits;
}

#if RULE_MODE == RULE_EXPR
// Whether the rule alone decides partial tile (sub-block bits `sub`) from key k0: every layout block of the tile
// partial and every key inside the sequence (the diagonal and window-edge tiles of causal and local layouts).
// There the per-element block bits can be skipped; they cost several times the rule's own arithmetic.
__device__ __forceinline__ bool rule_decides(const Params& p, const ulonglong2& sub, int k0) {
    const int cells = (TILE_M >> p.sub_q_shift) * p.sub_k_count;
    const unsigned long long all = cells >= 64 ? ~0ull : (1ull << cells) - 1;
    return sub.x == all && sub.y == all && k0 + TILE_N <= p.seq_k;
}
#endif

// The sub-block bits of partial tile `pidx` (visible): which layout blocks of the tile are set and which are
// partial. The bit table of RULE_BITS decides alone.
__device__ __forceinline__ ulonglong2 sub_bits_of(const Params& p, int pidx) {
#if RULE_MODE == RULE_BITS
    return make_ulonglong2(0, 0);
#else
    return p.sub_bits[pidx];
#endif
}

// `visible` at each of the warp's elements of partial tile `pidx` (sub-block bits `sub`), as mask_bits lays
// them out.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ ElementBits<COLS> block_bits(const Params& p, int pidx, const ulonglong2& sub, int b,
                                                        int h, int q0, int k0, int row0, int lane) {
    return gather_bits<TRANSPOSED, COLS>(row0, lane,
                                         [&](int qi, int ki) { return visible(p, pidx, sub, b, h, q0, k0, qi, ki); });
}

#if RULE_BAND || RULE_QBAND
// The elements of a thread's share of a warp's row of 128 columns (bit 2n + c: column 8n + 2t + c, t = lane % 4)
// that lie before column x: the bits below their count, so that ptxas selects the elements by their bits (R2P,
// seven predicates an instruction) instead of comparing each column. __funnelshift_lc clamps the count to 32.
__device__ __forceinline__ unsigned columns_before(int x, int t) {
    const int y = min(max(x - 2 * t, 0), 128);
    return __funnelshift_lc(~0u, 0u, (y >> 3) * 2 + min(y & 7, 2));
}

// The columns of a thread's share of 128 of a row's, from col0, that the rule's band lets through, as
// columns_before lays them out: rows are queries and columns keys (CSA_RULE_FIRST / LAST), or the transpose
// (CSA_RULE_QFIRST / QLAST, the backward's tiles whose rows are keys). 32-bit integers (TokenRule.narrow).
template <bool TRANSPOSED>
__device__ __forceinline__ unsigned band_columns(const Params& p, int b, int h, int row, int col0, int t) {
    using RuleInt = int;
    unsigned keep = ~0u;
    if constexpr (TRANSPOSED) {
        [[maybe_unused]] const int k = row;
#ifdef CSA_RULE_QLAST
        keep &= columns_before(CSA_RULE_QLAST(b, h, k) + 1 - col0, t);
#endif
#ifdef CSA_RULE_QFIRST
        keep &= ~columns_before(CSA_RULE_QFIRST(b, h, k) - col0, t);
#endif
    } else {
        [[maybe_unused]] const int q = row;
#ifdef CSA_RULE_LAST
        keep &= columns_before(CSA_RULE_LAST(b, h, q) + 1 - col0, t);
#endif
#ifdef CSA_RULE_FIRST
        keep &= ~columns_before(CSA_RULE_FIRST(b, h, q) - col0, t);
#endif
    }
    return keep;
}

// mask_bits where the rule alone decides and is a band: each of the thread's rows from its two ends, where the
// rule at each element took several times the instructions.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ ElementBits<COLS> band_bits(const Params& p, int b, int h, int q0, int k0, int row0,
                                                       int lane) {
    const int g = lane >> 2, t = lane & 3;
    ElementBits<COLS> bits;
#pragma unroll
    for (int w = 0; w < (COLS + 127) / 128; ++w)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = (TRANSPOSED ? k0 : q0) + row0 + g + 8 * r, col0 = (TRANSPOSED ? q0 : k0) + 128 * w;
            bits.word[w] |= (unsigned long long)band_columns<TRANSPOSED>(p, b, h, row, col0, t) << (32 * r);
        }
    return bits;
}
#endif

// Which elements of a warp's 16 x COLS accumulator tile are visible (ElementBits), in partial tile `pidx` of
// the plan; none for a full tile (pidx < 0), which is applied no mask.
// Rows are queries and columns keys, or the transpose (the dK/dV pass); `row0` is the warp's first row in the
// tile. Computed before the scores exist, so that the rule's arithmetic does not compete with the score
// accumulators for registers.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ ElementBits<COLS> mask_bits(const Params& p, int pidx, int b, int h, int q0, int k0,
                                                       int row0, int lane) {
    if (pidx < 0) return {};
    const ulonglong2 sub = sub_bits_of(p, pidx);
#if RULE_MODE == RULE_EXPR
    if (rule_decides(p, sub, k0)) {
#if RULE_NARROWABLE
        if (p.rule_narrow) {
#if RULE_BAND || RULE_QBAND
            // Not at head dim 256, whose portable dK/dV pass (255 registers) spilled 4 bytes with it.
            if constexpr ((TRANSPOSED ? RULE_QBAND : RULE_BAND) && HEAD_DIM <= 128)
                return band_bits<TRANSPOSED, COLS>(p, b, h, q0, k0, row0, lane);
#endif
            return gather_bits<TRANSPOSED, COLS>(
                row0, lane, [&](int qi, int ki) { return rule_at<int>(p, b, h, q0 + qi, k0 + ki); });
        }
#endif
        return gather_bits<TRANSPOSED, COLS>(
            row0, lane, [&](int qi, int ki) { return rule_at<long long>(p, b, h, q0 + qi, k0 + ki); });
    }
#endif
    return block_bits<TRANSPOSED, COLS>(p, pidx, sub, b, h, q0, k0, row0, lane);
}

// ---- score mods ---------------------------------------------------------------------------------------------
// The global (query, key) positions of element [n][j] of a warp's 16 x COLS accumulator tile: rows are queries
// (or keys when TRANSPOSED) from row0 of the tile at (q_tile0, k_tile0); the layout's origin is added, so the
// window of a longer sequence sees that sequence's positions.
template <bool TRANSPOSED>
struct TilePos {
    long long q0, k0;

    __device__ __forceinline__ TilePos(const Params& p, int q_tile0, int k_tile0, int row0, int lane) {
        const int r = row0 + (lane >> 2), c = 2 * (lane & 3);
        q0 = p.q_origin + q_tile0 + (TRANSPOSED ? c : r);
        k0 = p.k_origin + k_tile0 + (TRANSPOSED ? r : c);
    }
    __device__ __forceinline__ long long q(int n, int j) const {
        return q0 + (TRANSPOSED ? n * 8 + (j & 1) : 8 * (j >> 1));
    }
    __device__ __forceinline__ long long k(int n, int j) const {
        return k0 + (TRANSPOSED ? 8 * (j >> 1) : n * 8 + (j & 1));
    }
};

// The factor the softmax applies to s: the scale, unless a score mod has applied it already.
__device__ __forceinline__ float softmax_scale(const Params& p) { return SCORE_MOD ? 1.f : p.scale; }

// s <- mod(scale * s) over a warp's raw scores (q . k); nothing without a score mod. The mask applies after
// it, so that no mod revives a masked score.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ void apply_score_mod(const Params& p, float (&s)[COLS / 8][4], int b, int h,
                                                const TilePos<TRANSPOSED>& pos) {
#if SCORE_MOD
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            s[n][j] = CSA_SCORE((s[n][j] * p.scale), (long long)b, (long long)h, pos.q(n, j), pos.k(n, j));
#endif
}

// The backward's form: also dp <- (dp - delta) * mod'(scale * s), with delta(n, j) the delta of the element's
// query; `dscore` then finishes dS.
template <bool TRANSPOSED, int COLS, class Delta>
__device__ __forceinline__ void apply_score_mod(const Params& p, float (&s)[COLS / 8][4], float (&dp)[COLS / 8][4],
                                                Delta&& delta, int b, int h, const TilePos<TRANSPOSED>& pos) {
#if SCORE_MOD
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float x = s[n][j] * p.scale;
            const long long q = pos.q(n, j), k = pos.k(n, j);
            dp[n][j] = (dp[n][j] - delta(n, j)) * CSA_SCORE_GRAD(x, (long long)b, (long long)h, q, k);
            s[n][j] = CSA_SCORE(x, (long long)b, (long long)h, q, k);
        }
#endif
}

// dS = P * (dp - delta) of one element (before the softmax scale), from the dp that apply_score_mod left.
__device__ __forceinline__ float dscore(float prob, float dp, float delta) {
#if SCORE_MOD
    return prob > 0.f ? prob * dp : 0.f;  // the mod's derivative may be inf or NaN where P is 0
#else
    return prob * (dp - delta);
#endif
}

// Sets the scores that `bits` (from mask_bits) hides to -inf: exp2 then gives exactly 0.
template <int COLS>
__device__ __forceinline__ void apply_mask(float (&s)[COLS / 8][4], const ElementBits<COLS>& bits) {
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (!bits.at(n, j)) s[n][j] = -INFINITY;
}

#if RULE_BAND
// Sets to -inf the scores of a warp's 16 x COLS tile (rows from row0 of the query tile at q0, columns from key
// k0) outside the rule's band, in 32-bit integers (TokenRule.narrow): two numbers a row instead of the rule at
// each element, fewer instructions (docs/tuning.md: hide_outside_band).
template <int COLS>
__device__ __forceinline__ void hide_outside_band(const Params& p, float (&s)[COLS / 8][4], int b, int h, int q0,
                                                  int k0, int row0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = q0 + row0 + g + 8 * r;
#pragma unroll
        for (int w = 0; w < (COLS + 127) / 128; ++w) {
            const unsigned keep = band_columns<false>(p, b, h, q, k0 + 128 * w, t);
#pragma unroll
            for (int i = 0; i < 32 && 16 * w + i / 2 < COLS / 8; ++i)
                if (!((keep >> i) & 1u)) s[16 * w + i / 2][2 * r + i % 2] = -INFINITY;
        }
    }
}
#endif

// A partial tile's mask over a warp's 16 x COLS accumulator tile (rows are queries), in two halves around the
// wait for the scores. The constructor runs before it: the tile's cell bits or, for a bit table (RULE_BITS),
// the bits of every element (block_bits). hide(s) runs once the scores have landed and sets what the mask
// hides to -inf: where the rule alone decides the warp's rows, it evaluates the rule at each element as it
// selects it (a band, RULE_BAND: at each row's ends); else, for each 8 columns, it reads their cell's bits (set,
// decided by the rule) and evaluates the rule only inside cells that it decides. That takes a fraction of the
// instructions of gathering a bit for each element and applying them, which key tiles of 192 over blocks of
// 128 (cells of 64, a warp's row of them mixed: whole, empty, the rule's) paid in every tile that crossed a
// block's edge. Nothing for a full tile (pidx < 0).
//
// A warp's 16 rows lie in one row of the tile's cells (blocks are at least 16 long), so where the tile ends
// before the keys do, the warp's part may be whole (no mask), empty or all rule though the tile is not: a
// query tile of 192 rows over blocks of 128 is partial wherever it crosses a block's edge. A cell is at least
// 16 keys wide, so 8 columns lie in one, and a row of a tile of at most 256 keys holds at most 16 of them.
template <int COLS>
struct TileMask {
    int pidx;
#if RULE_MODE == RULE_BITS
    ElementBits<COLS> bits;
#else
    unsigned cells_set = 0, cells_rule = 0;  // the warp's row of cells, a bit each: set; decided by the rule
    bool inside = true, by_rule = false;     // the tile ends before the keys do; the rule decides every cell
#endif

    __device__ __forceinline__ TileMask(const Params& p, int pidx_, int b, int h, int q0, int k0, int row0, int lane)
        : pidx(pidx_) {
        static_assert(COLS <= 256, "a warp's row of cells fits 16 bits");
        if (pidx < 0) return;
        const ulonglong2 sub = sub_bits_of(p, pidx);
#if RULE_MODE == RULE_BITS
        bits = block_bits<false, COLS>(p, pidx, sub, b, h, q0, k0, row0, lane);
#else
        const int shift = (row0 >> p.sub_q_shift) * p.sub_k_count;
        const unsigned row = (1u << p.sub_k_count) - 1;
        cells_set = static_cast<unsigned>(sub.x >> shift) & row;
        cells_rule = static_cast<unsigned>(sub.y >> shift) & row;
        inside = k0 + TILE_N <= p.seq_k;
        if (inside && cells_set == row && cells_rule == 0) pidx = -1;
        by_rule = inside && cells_set == row && cells_rule == row;
#endif
    }

    __device__ __forceinline__ void hide(const Params& p, float (&s)[COLS / 8][4], int b, int h, int q0, int k0,
                                         int row0, int lane) const {
        if (pidx < 0) return;
#if RULE_MODE == RULE_BITS
        apply_mask<COLS>(s, bits);
#else
#if RULE_MODE == RULE_EXPR
        if (by_rule) {
#if RULE_NARROWABLE
            if (p.rule_narrow) {
#if RULE_BAND
                hide_outside_band<COLS>(p, s, b, h, q0, k0, row0, lane);
#else
                for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
                    if (!rule_at<int>(p, b, h, q0 + row, k0 + col)) s[n][j] = -INFINITY;
                });
#endif
                return;
            }
#endif
            for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
                if (!rule_at<long long>(p, b, h, q0 + row, k0 + col)) s[n][j] = -INFINITY;
            });
            return;
        }
#endif
        // Rows of mixed cells are rare (a tile across a block's edge, the sequence's end): the rule in long long
        // alone keeps the code small.
        for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
            const int cell = (n * 8) >> p.sub_k_shift;
            bool visible = ((cells_set >> cell) & 1u) && (inside || k0 + col < p.seq_k);
#if RULE_MODE == RULE_EXPR
            visible = visible && (!((cells_rule >> cell) & 1u) || rule_at<long long>(p, b, h, q0 + row, k0 + col));
#endif
            if (!visible) s[n][j] = -INFINITY;
        });
#endif
    }
};

// ---- the backward ------------------------------------------------------------------------------------------
enum Stat { STAT_LSE2 = 0, STAT_DELTA = 1, STAT_DQ = 2 };
__device__ __forceinline__ float* stat_row(const Params& p, int b, int h, Stat stat) {
    return p.stats + b * p.stats_sb + h * p.stats_sh + stat * p.stats_sr;
}
// The fused backward's scratch past the statistics: HEAD_DIM rows that hold the fp32 dQ sums as
// [query tile][HEAD_DIM / 8][TILE_M][8] (the padded length holds whole tiles), then a row of int counters, one
// per query tile: the adds done so far (zeroed by the statistics pass). Eight columns of a row are 32 bytes
// apart from the next row's: a warp's store of its accumulators' eight rows (two columns a thread) is 256
// contiguous bytes, where row-major rows fell on the same shared-memory banks (four ways).
__device__ __forceinline__ float* dq_sum(const Params& p, int b, int h, int tile_q) {
    return stat_row(p, b, h, STAT_DQ) + (long long)tile_q * TILE_M * HEAD_DIM;
}
__device__ __forceinline__ int* dq_counters(const Params& p, int b, int h) {
    return reinterpret_cast<int*>(stat_row(p, b, h, STAT_DQ) + (long long)HEAD_DIM * p.stats_sr);
}

// The dQ pass's statistics of the warp's 16 rows from row0, returned for rows g and g + 8 (the rows of the
// thread's accumulators) and written out for the dK/dV pass, over the whole padded length (rows past the
// sequence too, so that a tile copied whole holds no garbage):
// - delta = rowsum(dO * O) in fp32. Lanes 2r and 2r + 1 share row r, 8 elements per 16-byte load.
// - lse2 = lse * log2(e): +inf past the sequence and for rows that attend to nothing (lse = -inf), so that
//   exp2(s - lse2) gives P = 0 there.
__device__ __forceinline__ void row_stats(const Params& p, int b, int h, int row0, int lane, float (&lse2)[2],
                                          float (&delta)[2]) {
    const int r = lane >> 1, q = row0 + r;
    float sum = 0.f;
    if (q < p.seq_q) {
        const elem_t* o_row = p.o + b * p.o_sb + h * p.o_sh + (long long)q * p.o_ss;
        const elem_t* do_row = p.dout + b * p.do_sb + h * p.do_sh + (long long)q * p.do_ss;
        for (int c = (lane & 1) * 8; c < HEAD_DIM_REAL; c += 16) {
            const uint4 ov = *reinterpret_cast<const uint4*>(o_row + c);
            const uint4 dv = *reinterpret_cast<const uint4*>(do_row + c);
            const elem2_t* o2 = reinterpret_cast<const elem2_t*>(&ov);
            const elem2_t* d2 = reinterpret_cast<const elem2_t*>(&dv);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 of = unpack2(o2[j]), df = unpack2(d2[j]);
                sum = fmaf(of.x, df.x, fmaf(of.y, df.y, sum));
            }
        }
    }
    sum = lanes_sum<2>(sum);
    const float lse = q < p.seq_q ? p.lse[b * p.lse_sb + h * p.lse_sh + q] : -INFINITY;
    const float l2 = lse == -INFINITY ? INFINITY : lse * LOG2E;
    if (q < p.stats_sr) stat_row(p, b, h, (lane & 1) ? STAT_LSE2 : STAT_DELTA)[q] = (lane & 1) ? l2 : sum;
    const int g = lane >> 2;
    delta[0] = __shfl_sync(0xffffffffu, sum, 2 * g);
    delta[1] = __shfl_sync(0xffffffffu, sum, 2 * (g + 8));
    lse2[0] = __shfl_sync(0xffffffffu, l2, 2 * g);
    lse2[1] = __shfl_sync(0xffffffffu, l2, 2 * (g + 8));
}

// The dQ pass's dS = P * (dP - delta) in place of the masked scores s of a warp's rows, P = exp2(s * scale_log2
// - lse2); dp as apply_score_mod left it.
template <int COLS>
__device__ __forceinline__ void scores_to_ds(float (&s)[COLS / 8][4], const float (&dp)[COLS / 8][4],
                                             const float (&lse2)[2], const float (&delta)[2], float scale_log2) {
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float prob = exp2f(fmaf(s[n][j], scale_log2, -lse2[j >> 1]));
            s[n][j] = dscore(prob, dp[n][j], delta[j >> 1]);
        }
}

// P^T = exp2(S^T * scale_log2 - lse2) in place of S^T (a warp's 16 keys by COLS queries, whose lse2 lies in
// shared memory), where the partial tile's mask (keep: its mask_bits) lets it through. t: the thread's place in
// its quad (lane & 3).
template <int COLS>
__device__ __forceinline__ void transposed_probs(float (&st)[COLS / 8][4], const float* lse2, bool partial,
                                                 const ElementBits<COLS>& keep, float scale_log2, int t) {
    if (partial) apply_mask<COLS>(st, keep);
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) st[c][jj] = exp2f(fmaf(st[c][jj], scale_log2, -lse2[c * 8 + 2 * t + (jj & 1)]));
}

// dS^T = P^T * (dP^T - delta) in place of dP^T, from transposed_probs's P^T (delta in shared memory).
template <int COLS>
__device__ __forceinline__ void transposed_ds(const float (&pt)[COLS / 8][4], float (&dpt)[COLS / 8][4],
                                              const float* delta, int t) {
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) dpt[c][jj] = dscore(pt[c][jj], dpt[c][jj], delta[c * 8 + 2 * t + (jj & 1)]);
}

// The dK/dV passes' P^T and dS^T in place of S^T and dP^T, once those have landed: the score mod, then
// transposed_probs and transposed_ds. Without a score mod the fused backward runs the two apart, P^T while
// dP^T's product is in flight.
template <int COLS>
__device__ __forceinline__ void transposed_scores_to_ds(const Params& p, float (&st)[COLS / 8][4],
                                                        float (&dpt)[COLS / 8][4], const float* lse2,
                                                        const float* delta, bool partial, const ElementBits<COLS>& keep,
                                                        float scale_log2, int b, int h, const TilePos<true>& pos,
                                                        int t) {
    apply_score_mod<true, COLS>(p, st, dpt, [&](int c, int jj) { return delta[c * 8 + 2 * t + (jj & 1)]; }, b, h, pos);
    transposed_probs<COLS>(st, lse2, partial, keep, scale_log2, t);
    transposed_ds<COLS>(st, dpt, delta, t);
}

// P^T and dS^T, made without the mask (transposed_probs and transposed_ds), set to 0 where `bits` (from
// mask_bits) hides them: exp2 may have overflowed there, as the row's lse leaves out what the mask hides.
template <int COLS>
__device__ __forceinline__ void zero_hidden(float (&pt)[COLS / 8][4], float (&dst)[COLS / 8][4],
                                            const ElementBits<COLS>& bits) {
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (!bits.at(c, j)) pt[c][j] = dst[c][j] = 0.f;
}

}  // namespace csa
