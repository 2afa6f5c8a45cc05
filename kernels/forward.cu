// Block-sparse flash attention, forward pass (mma.sync, sm_80+).
//
// One CTA per (query tile, query head, batch element). Each warp owns 16 query rows of the tile and keeps its
// Q fragments in registers (head dims up to 128); the CTA walks only the key tiles that its row of the tile
// table lists, double buffering K and V through cp.async, and keeps the softmax and the output accumulators in
// fp32 registers. Writes out [B, Hq, Sq, D] and lse [B, Hq, Sq] (natural log; -inf for rows that attend to
// nothing).
#include "common.cuh"

using namespace csa;

constexpr int THREADS = NWARPS * 32;
static_assert(TILE_M == NWARPS * 16, "each warp owns 16 query rows");
static_assert(TILE_N % 16 == 0 && HEAD_DIM % 16 == 0, "tiles are whole MMA shapes");

// Shared memory: the Q tile, then two stages of (K tile, V tile).
constexpr int Q_ELEMS = TILE_M * SMEM_ROW;
constexpr int KV_ELEMS = TILE_N * SMEM_ROW;
constexpr int SMEM_BYTES = (Q_ELEMS + 2 * 2 * KV_ELEMS) * sizeof(elem_t);
static_assert(SMEM_BYTES == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

// The online softmax over the two rows a thread holds (g and g + 8 of the warp's 16).
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

extern "C" __global__ void __launch_bounds__(THREADS)
    csa_forward(const __grid_constant__ Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* kv_smem = q_smem + Q_ELEMS;  // stage s: K at kv_smem + s * 2 * KV_ELEMS, V after it
    if (threadIdx.x == 0 && dynamic_smem_size() < SMEM_BYTES) __trap();

    // Heaviest rows of causal-like layouts are the last ones: start them first.
    const int tile_q = p.tiles_q - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = h / p.group;
    const int line = layout_line(p, b, h) * p.tiles_q + tile_q;
    const int begin = p.row_ptr[line], count = p.row_ptr[line + 1] - begin;

    const int q_tile0 = tile_q * TILE_M;
    const elem_t* k_head = p.k + b * p.k_sb + hk * p.k_sh;
    const elem_t* v_head = p.v + b * p.v_sb + hk * p.v_sh;

    float o[HEAD_DIM / 8][4];
    zero(o);
    OnlineSoftmax sm;
    sm.init();
    RowFrag<(HEAD_DIM <= 128)> qf;

    if (count > 0) load_tile_async<TILE_M, THREADS>(q_smem, p.q + b * p.q_sb + h * p.q_sh, p.q_ss, q_tile0, p.seq_q);
    pipeline2(
        count,
        [&](int stage, int i) {
            load_kv_async<TILE_N, THREADS>(kv_smem + stage * 2 * KV_ELEMS, k_head, v_head, p,
                                           p.entries[begin + i].x * TILE_N);
        },
        [&](int stage, int i) {
            const int2 e = p.entries[begin + i];
            if (i == 0) qf.load(q_smem + warp * 16 * SMEM_ROW, lane);
            const elem_t* ks = kv_smem + stage * 2 * KV_ELEMS;
            const unsigned long long keep =
                e.y >= 0 ? mask_bits<false, TILE_N>(p, e.y, b, h, q_tile0, e.x * TILE_N, warp * 16, lane) : 0;
            float s[TILE_N / 8][4];
            mma_ABt<TILE_N>(s, qf, ks, lane);
            apply_score_mod<false, TILE_N>(p, s, b, h, TilePos<false>(p, q_tile0, e.x * TILE_N, warp * 16, lane));
            if (e.y >= 0) apply_mask<TILE_N>(s, keep);
            sm.update(s, o, softmax_scale(p));
            mma_AB<TILE_N, HEAD_DIM>(o, s, ks + KV_ELEMS, lane);
        });

    // out = acc / l (0 where the row saw nothing) and lse = m * ln2 + ln(l).
    const int g = lane >> 2, t = lane & 3;
    const int row0 = q_tile0 + warp * 16;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(sm.l[r]);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int q = row0 + g + 8 * r;
        if (t == 0 && q < p.seq_q)
            p.lse[b * p.lse_sb + h * p.lse_sh + q] = l > 0.f ? sm.m[r] * LN2 + logf(l) : -INFINITY;
    }
    store_rows<HEAD_DIM>(o, inv, p.o + b * p.o_sb + h * p.o_sh, p.o_ss, row0, p.seq_q, 0, lane);
}
