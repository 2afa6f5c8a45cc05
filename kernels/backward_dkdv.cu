// Block-sparse flash attention, backward pass 2 of 2: dK and dV (mma.sync).
//
// One CTA per (key tile, key/value head, batch element) and, for head dims above 128, per half of the head
// dimension of the outputs. K and V stay in shared memory; the CTA walks the query tiles of its column of the
// tile table (only those that attend to it), for every query head of its group in turn, double buffering Q,
// dO and their statistics lse * log2(e) and delta (written by pass 1). Each warp owns 16 keys and works on
// transposed scores: it recomputes P^T = exp(K Q^T - lse), accumulates dV += P^T dO, forms
// dS^T = P^T * (V dO^T - delta) and accumulates dK += dS^T Q, all in fp32 registers, then writes both once:
// no atomics, and the heads of a group add up in a fixed order, so two runs give the same bits. Keys no query
// attends to get zero gradients.
#include "common.cuh"

using namespace csa;

constexpr int THREADS = NWARPS * 32;
static_assert(TILE_N == NWARPS * 16, "each warp owns 16 keys");
static_assert(TILE_M % 16 == 0 && HEAD_DIM % 16 == 0, "tiles are whole MMA shapes");

// Past 128, the dK and dV accumulators of the whole head dimension would not fit in registers: each CTA then
// produces one half of the columns (and recomputes the scores for it).
constexpr int SPLITS = HEAD_DIM > 128 ? 2 : 1;
constexpr int DW = HEAD_DIM / SPLITS;
static_assert(DW % 16 == 0, "a column slice is whole MMA shapes");

// Shared memory: the K and V tiles, two stages of (Q tile, dO tile), two stages of (lse2, delta) vectors.
constexpr int KV_ELEMS = TILE_N * SMEM_ROW;
constexpr int Q_ELEMS = TILE_M * SMEM_ROW;
constexpr int SMEM_BYTES = (2 * KV_ELEMS + 2 * 2 * Q_ELEMS) * sizeof(elem_t) + 2 * 2 * TILE_M * sizeof(float);
static_assert(SMEM_BYTES == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void CSA_LAUNCH_BOUNDS
    csa_backward_dkdv(const __grid_constant__ Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_smem = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* v_smem = k_smem + KV_ELEMS;
    elem_t* qdo_smem = v_smem + KV_ELEMS;  // stage s: Q at qdo_smem + s * 2 * Q_ELEMS, dO after it
    float* vec_smem = reinterpret_cast<float*>(qdo_smem + 2 * 2 * Q_ELEMS);  // stage s: lse2, then delta
    if (threadIdx.x == 0 && dynamic_smem_size() < SMEM_BYTES) __trap();

    const int tile_k = blockIdx.x;  // the first key tiles are the heaviest columns of causal-like layouts
    const int hk = blockIdx.y / SPLITS, split = blockIdx.y % SPLITS, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = lane & 3;
    const int k_tile0 = tile_k * TILE_N;
    const float scale_log2 = softmax_scale(p) * LOG2E;

    int total = 0;
    for (int j = 0; j < p.group; ++j) total += column_span(p, b, hk * p.group + j, tile_k).count;
    if (total > 0)
        load_kv_async<TILE_N, THREADS>(k_smem, p.k + b * p.k_sb + hk * p.k_sh, p.v + b * p.v_sb + hk * p.v_sh, p,
                                       k_tile0);

    float dk[DW / 8][4], dv[DW / 8][4];
    zero(dk);
    zero(dv);
    RowFrag<(ROW_BYTES <= 128)> kf, vf;
    bool frags_loaded = false;

    for (int j = 0; j < p.group; ++j) {
        const int h = hk * p.group + j;
        const Span span = column_span(p, b, h, tile_k);
        const int begin = span.begin, count = span.count;
        const elem_t* q_head = p.q + b * p.q_sb + h * p.q_sh;
        const elem_t* do_head = p.dout + b * p.do_sb + h * p.do_sh;
        // Pass 1 wrote the statistics over all rows of its query tiles, which are no smaller than these: the
        // rows past the sequence have lse2 = +inf (P = 0) and delta = 0.
        const float* lse2_head = stat_row(p, b, h, STAT_LSE2);
        const float* delta_head = lse2_head + p.stats_sr;
        pipeline2(
            count,
            [&](int stage, int i) {
                const int q0 = p.col_entries[begin + i].x * TILE_M;
                elem_t* qs = qdo_smem + stage * 2 * Q_ELEMS;
                load_tile_async<TILE_M, THREADS>(qs, q_head, p.q_ss, q0, p.seq_q);
                load_tile_async<TILE_M, THREADS>(qs + Q_ELEMS, do_head, p.do_ss, q0, p.seq_q);
                float* vs = vec_smem + stage * 2 * TILE_M;
                load_vec_async<TILE_M, THREADS>(vs, lse2_head, q0, p.stats_sr);
                load_vec_async<TILE_M, THREADS>(vs + TILE_M, delta_head, q0, p.stats_sr);
            },
            [&](int stage, int i) {
                const int2 e = p.col_entries[begin + i];
                const int q0 = e.x * TILE_M;
                if (!frags_loaded) {
                    kf.load(k_smem + warp * 16 * SMEM_ROW, lane);
                    vf.load(v_smem + warp * 16 * SMEM_ROW, lane);
                    frags_loaded = true;
                }
                const elem_t* qs = qdo_smem + stage * 2 * Q_ELEMS;
                const elem_t* dos = qs + Q_ELEMS;
                const float* lse2_s = vec_smem + stage * 2 * TILE_M;
                const float* delta_s = lse2_s + TILE_M;

                const auto keep = mask_bits<true, TILE_M>(p, e.y, b, h, q0, k_tile0, warp * 16, lane);
                float st[TILE_M / 8][4], dpt[TILE_M / 8][4];  // S^T (the warp's 16 keys x TILE_M queries), (dO V^T)^T
                mma_ABt<TILE_M>(st, kf, qs, lane);
                // A score mod's derivative folds into dpt while the raw scores are at hand; without one, dpt
                // comes after dV += P^T dO, which keeps fewer registers live.
                if constexpr (SCORE_MOD) mma_ABt<TILE_M>(dpt, vf, dos, lane);
                apply_score_mod<true, TILE_M>(
                    p, st, dpt, [&](int n, int j) { return delta_s[n * 8 + 2 * t + (j & 1)]; }, b, h,
                    TilePos<true>(p, q0, k_tile0, warp * 16, lane));
                if (e.y >= 0) apply_mask<TILE_M>(st, keep);
#pragma unroll
                for (int n = 0; n < TILE_M / 8; ++n)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        st[n][j] = exp2f(fmaf(st[n][j], scale_log2, -lse2_s[n * 8 + 2 * t + (j & 1)]));  // P^T
                mma_AB<TILE_M, DW, true>(dv, st, dos + split * DW, lane);
                if constexpr (!SCORE_MOD) mma_ABt<TILE_M>(dpt, vf, dos, lane);
#pragma unroll
                for (int n = 0; n < TILE_M / 8; ++n)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        st[n][j] = dscore(st[n][j], dpt[n][j], delta_s[n * 8 + 2 * t + (j & 1)]);  // dS^T
                mma_AB<TILE_M, DW, true>(dk, st, qs + split * DW, lane);
            });
    }

    const int row0 = k_tile0 + warp * 16;
    const float one[2] = {1.f, 1.f}, scale[2] = {p.scale, p.scale};
    store_rows<DW>(dv, one, p.dv + b * p.dv_sb + hk * p.dv_sh, p.dv_ss, row0, p.seq_k, split * DW, lane);
    store_rows<DW>(dk, scale, p.dk + b * p.dk_sb + hk * p.dk_sh, p.dk_ss, row0, p.seq_k, split * DW, lane);
}
