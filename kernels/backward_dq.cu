// Block-sparse flash attention, backward pass 1 of 2: dQ, and pass 2's row statistics (mma.sync).
//
// One CTA per (query tile, query head, batch element), walking the key tiles of its row of the tile table as
// the forward does. Each warp owns 16 query rows: it recomputes P = exp(S - lse) from Q K^T, forms
// dS = P * (dO V^T - delta) and accumulates dQ = scale * dS K in fp32 registers, then writes it once: no
// atomics, so two runs give the same bits. Rows that attend to nothing get dQ = 0.
#include "common.cuh"

using namespace csa;

constexpr int THREADS = NWARPS * 32;
static_assert(TILE_M == NWARPS * 16, "each warp owns 16 query rows");
static_assert(TILE_N % 16 == 0 && HEAD_DIM % 16 == 0, "tiles are whole MMA shapes");

// Shared memory: the Q and dO tiles, then two stages of (K tile, V tile).
constexpr int Q_ELEMS = TILE_M * SMEM_ROW;
constexpr int KV_ELEMS = TILE_N * SMEM_ROW;
constexpr int SMEM_BYTES = (2 * Q_ELEMS + 2 * 2 * KV_ELEMS) * sizeof(elem_t);
static_assert(SMEM_BYTES == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void CSA_LAUNCH_BOUNDS
    csa_backward_dq(const __grid_constant__ Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* do_smem = q_smem + Q_ELEMS;
    elem_t* kv_smem = do_smem + Q_ELEMS;  // stage s: K at kv_smem + s * 2 * KV_ELEMS, V after it
    if (threadIdx.x == 0 && dynamic_smem_size() < SMEM_BYTES) __trap();

    const int tile_q = query_tile(p);
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = h / p.group;
    const Span span = row_span(p, b, h, tile_q);
    const int begin = span.begin, count = span.count;

    const int q_tile0 = tile_q * TILE_M, row0 = q_tile0 + warp * 16;
    const elem_t* k_head = p.k + b * p.k_sb + hk * p.k_sh;
    const elem_t* v_head = p.v + b * p.v_sb + hk * p.v_sh;
    const float scale_log2 = softmax_scale(p) * LOG2E;

    if (count > 0) {
        load_tile_async<TILE_M, THREADS>(q_smem, p.q + b * p.q_sb + h * p.q_sh, p.q_ss, q_tile0, p.seq_q);
        load_tile_async<TILE_M, THREADS>(do_smem, p.dout + b * p.do_sb + h * p.do_sh, p.do_ss, q_tile0, p.seq_q);
    }
    float delta[2], lse2[2];
    row_stats(p, b, h, row0, lane, lse2, delta);

    float dq[HEAD_DIM / 8][4];
    zero(dq);
    RowFrag<(ROW_BYTES <= 256)> qf, dof;
    pipeline2(
        count,
        [&](int stage, int i) {
            load_kv_async<TILE_N, THREADS>(kv_smem + stage * 2 * KV_ELEMS, k_head, v_head, p,
                                           p.entries[begin + i].x * TILE_N);
        },
        [&](int stage, int i) {
            const int2 e = p.entries[begin + i];
            if (i == 0) {
                qf.load(q_smem + warp * 16 * SMEM_ROW, lane);
                dof.load(do_smem + warp * 16 * SMEM_ROW, lane);
            }
            const elem_t* ks = kv_smem + stage * 2 * KV_ELEMS;
            const auto keep = mask_bits<false, TILE_N>(p, e.y, b, h, q_tile0, e.x * TILE_N, warp * 16, lane);
            float s[TILE_N / 8][4];
            mma_ABt<TILE_N>(s, qf, ks, lane);
            float dp[TILE_N / 8][4];
            mma_ABt<TILE_N>(dp, dof, ks + KV_ELEMS, lane);
            apply_score_mod<false, TILE_N>(
                p, s, dp, [&](int, int j) { return delta[j >> 1]; }, b, h,
                TilePos<false>(p, q_tile0, e.x * TILE_N, warp * 16, lane));
            if (e.y >= 0) apply_mask<TILE_N>(s, keep);
            scores_to_ds<TILE_N>(s, dp, lse2, delta, scale_log2);
            mma_AB<TILE_N, HEAD_DIM, true>(dq, s, ks, lane);
        });

    const float factor[2] = {p.scale, p.scale};
    store_rows<HEAD_DIM>(dq, factor, p.dq + b * p.dq_sb + h * p.dq_sh, p.dq_ss, row0, p.seq_q, 0, lane);
}
