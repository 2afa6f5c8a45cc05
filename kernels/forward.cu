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
// Split TF32's fresh sums (mma_AB): past head dim 128 the output's accumulators leave no registers for them.
constexpr bool FRESH_SUMS = HEAD_DIM <= 128;

extern "C" __global__ void CSA_LAUNCH_BOUNDS
    csa_forward(const __grid_constant__ Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* kv_smem = q_smem + Q_ELEMS;  // stage s: K at kv_smem + s * 2 * KV_ELEMS, V after it
    if (threadIdx.x == 0 && dynamic_smem_size() < SMEM_BYTES) __trap();

    const int tile_q = query_tile(p);
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = h / p.group;
    const Span span = row_span(p, b, h, tile_q);
    const int begin = span.begin, count = span.count;

    const int q_tile0 = tile_q * TILE_M;
    const elem_t* k_head = p.k + b * p.k_sb + hk * p.k_sh;
    const elem_t* v_head = p.v + b * p.v_sb + hk * p.v_sh;

    float o[HEAD_DIM / 8][4];
    zero(o);
    OnlineSoftmax sm;
    sm.init();
    RowFrag<(ROW_BYTES <= 256)> qf;

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
            const auto keep = mask_bits<false, TILE_N>(p, e.y, b, h, q_tile0, e.x * TILE_N, warp * 16, lane);
            float s[TILE_N / 8][4];
            mma_ABt<TILE_N>(s, qf, ks, lane);
            apply_score_mod<false, TILE_N>(p, s, b, h, TilePos<false>(p, q_tile0, e.x * TILE_N, warp * 16, lane));
            if (e.y >= 0) apply_mask<TILE_N>(s, keep);
            sm.update(s, o, softmax_scale(p));
            mma_AB<TILE_N, HEAD_DIM, FRESH_SUMS>(o, s, ks + KV_ELEMS, lane);
        });

    finish_rows(p, sm, o, b, h, q_tile0 + warp * 16, lane);
}
