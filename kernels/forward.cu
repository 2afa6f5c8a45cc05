// Block-sparse flash attention, forward pass (mma.sync, sm_80+).
//
// One CTA per (query tile, query head, batch element). Each warp owns 16 query rows of the tile and keeps its
// Q fragments in registers (head dims up to 128); the CTA walks only the key tiles that its row of the tile table lists, double
// buffering K and V through cp.async, and keeps the softmax and the output accumulators in fp32 registers.
// Writes out [B, Hq, Sq, D] and lse [B, Hq, Sq] (natural log; -inf for rows that attend to nothing).
#include "common.cuh"

using namespace csa;

constexpr int THREADS = NWARPS * 32;
static_assert(TILE_M == NWARPS * 16, "each warp owns 16 query rows");
static_assert(TILE_N % 16 == 0 && HEAD_DIM % 16 == 0, "tiles are whole MMA shapes");

// Shared memory: Q tile, then two stages of (K tile, V tile).
constexpr int Q_ELEMS = TILE_M * SMEM_ROW;
constexpr int KV_ELEMS = TILE_N * SMEM_ROW;

// Writes the warp's 16 rows: out = acc / l (0 where the row saw nothing) and lse = m * ln2 + ln(l).
__device__ __forceinline__ void store_rows(const Params& p, float (&o)[HEAD_DIM / 8][4], const OnlineSoftmax& sm,
                                           elem_t* o_head, float* lse_head, int q_row0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = q_row0 + g + 8 * r;
        const float l = quad_sum(sm.l[r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (q >= p.seq_q) continue;
        elem_t* row = o_head + (long long)q * p.o_ss;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d) {
            const int col = d * 8 + 2 * t;
            if (col < HEAD_DIM_REAL)
                *reinterpret_cast<elem2_t*>(row + col) = pack2(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
        }
        if (t == 0) lse_head[q] = l > 0.f ? sm.m[r] * LN2 + logf(l) : -INFINITY;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    csa_forward(const __grid_constant__ Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
    elem_t* k_smem = q_smem + Q_ELEMS;              // stage s at k_smem + s * 2 * KV_ELEMS
    elem_t* v_smem = k_smem + KV_ELEMS;

    // Heaviest rows of causal-like layouts are the last ones: start them first.
    const int tile_q = p.tiles_q - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = h / p.group;
    const int lrow = ((p.layout_batch > 1 ? b : 0) * p.layout_heads + (p.layout_heads > 1 ? h : 0)) * p.tiles_q + tile_q;
    const int begin = p.row_ptr[lrow], end = p.row_ptr[lrow + 1];

    const int q_tile0 = tile_q * TILE_M;
    const elem_t* q_head = p.q + b * p.q_sb + h * p.q_sh;
    const elem_t* k_head = p.k + b * p.k_sb + hk * p.k_sh;
    const elem_t* v_head = p.v + b * p.v_sb + hk * p.v_sh;
    elem_t* o_head = p.o + b * p.o_sb + h * p.o_sh;
    float* lse_head = p.lse + b * p.lse_sb + h * p.lse_sh;

    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    OnlineSoftmax sm;
    sm.init();

    if (begin < end) {
        load_tile_async<TILE_M, THREADS>(q_smem, q_head, p.q_ss, q_tile0, p.seq_q);
        int2 e = p.entries[begin];
        load_tile_async<TILE_N, THREADS>(k_smem, k_head, p.k_ss, e.x * TILE_N, p.seq_k);
        load_tile_async<TILE_N, THREADS>(v_smem, v_head, p.v_ss, e.x * TILE_N, p.seq_k);
        cp_async_commit();

        QFrag qf;
        for (int it = begin; it < end; ++it) {
            const int stage = (it - begin) & 1;
            // Issue the next tile's loads before waiting on this one, so that they overlap this tile's math.
            int2 next = make_int2(0, -1);
            if (it + 1 < end) {
                next = p.entries[it + 1];
                elem_t* ks = k_smem + (stage ^ 1) * 2 * KV_ELEMS;
                load_tile_async<TILE_N, THREADS>(ks, k_head, p.k_ss, next.x * TILE_N, p.seq_k);
                load_tile_async<TILE_N, THREADS>(ks + KV_ELEMS, v_head, p.v_ss, next.x * TILE_N, p.seq_k);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            if (it == begin) qf.load(q_smem + warp * 16 * SMEM_ROW, lane);

            const elem_t* ks = k_smem + stage * 2 * KV_ELEMS;
            float s[TILE_N / 8][4];
            mma_QKt(s, qf, ks, lane);
            if (e.y >= 0) apply_mask(s, p, e.y, b, h, q_tile0, e.x * TILE_N, warp * 16, lane);
            sm.update(s, o, p.scale);
            mma_PV(o, s, ks + KV_ELEMS, lane);
            // The next iteration's loads overwrite the stage this one read.
            __syncthreads();
            e = next;
        }
    }
    store_rows(p, o, sm, o_head, lse_head, q_tile0 + warp * 16, lane);
}
