// Block-sparse flash attention, backward pass 2 of 2 for Hopper (sm_90a): dK and dV.
//
// One CTA per (key tile, key/value head, batch element), three warpgroups. The producer copies the K and V
// tiles once and streams the (Q, dO) tiles of the layout's column, for every query head of the group in turn,
// through a ring. Each consumer warpgroup owns 64 keys and works on transposed scores: S^T = K Q^T and
// dP^T = V dO^T from shared memory, P^T = exp(S^T - lse) in registers, dV += P^T dO and dK += dS^T Q with
// the probabilities as register fragments and Q, dO read MN-major. Both are written once: no atomics, and the
// heads of a group add up in a fixed order, so two runs give the same bits. Keys no query attends to get zero
// gradients.
#include "hopper.cuh"

using namespace csa;

static_assert(TILE_N == CONSUMERS * 64, "two 64-key consumers");
static_assert(TILE_M % 16 == 0 && TILE_M <= 256, "a query tile is one wgmma N");

constexpr unsigned KV_BYTES = TILE_N * HEAD_DIM * sizeof(elem_t);
constexpr unsigned Q_BYTES = TILE_M * HEAD_DIM * sizeof(elem_t);

struct alignas(1024) Shared {
    elem_t k[TILE_N * HEAD_DIM];
    elem_t v[TILE_N * HEAD_DIM];
    elem_t q[STAGES][TILE_M * HEAD_DIM];
    elem_t dout[STAGES][TILE_M * HEAD_DIM];
    float vec[CONSUMERS][2][2][TILE_M];  // per consumer, two buffers of (lse * log2(e), delta) of a query tile
    Barrier kv_full;
    Ring<STAGES> q_ring;  // Q and dO
};
static_assert(sizeof(Shared) + 1024 == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    csa_backward_dkdv_sm90(const __grid_constant__ Params p, const __grid_constant__ TensorMap q_map,
                           const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map,
                           const __grid_constant__ TensorMap do_map) {
    extern __shared__ unsigned char smem_raw[];
    Shared& sh = aligned_shared<Shared>(smem_raw);
    if (threadIdx.x == 0 && dynamic_smem_size() < SHARED_BYTES) __trap();

    const int tile_k = blockIdx.x;  // the first key tiles are the heaviest columns of causal-like layouts
    const int hk = blockIdx.y, b = blockIdx.z;
    const int k_tile0 = tile_k * TILE_N;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        sh.kv_full.init(1);
        sh.q_ring.init(CONSUMERS * 128);
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        release_registers<24>();
        if (threadIdx.x == 0) {
            int n = 0;  // uses of the ring, over the heads of the group
            for (int j = 0; j < p.group; ++j) {
                const int h = hk * p.group + j;
                const Span span = column_span(p, b, h, tile_k);
                for (int i = 0; i < span.count; ++i, ++n) {
                    if (n == 0) {
                        sh.kv_full.expect_bytes(2 * KV_BYTES);
                        tma_load_tile(sh.k, k_map, sh.kv_full, k_tile0, hk, b);
                        tma_load_tile(sh.v, v_map, sh.kv_full, k_tile0, hk, b);
                    }
                    const int q0 = p.col_entries[span.begin + i].x * TILE_M;
                    Barrier& full = sh.q_ring.fill(n, 2 * Q_BYTES);
                    tma_load_tile(sh.q[n % STAGES], q_map, full, q0, h, b);
                    tma_load_tile(sh.dout[n % STAGES], do_map, full, q0, h, b);
                }
            }
        }
        return;
    }
    claim_registers<240>();

    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31, t = lane & 3;
    const int keys = consumer * 64;  // this consumer's first key in the tile
    const float scale_log2 = softmax_scale(p) * LOG2E;
    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM / 8][4];
    zero(dk);
    zero(dv);

    int n = 0;
    for (int j = 0; j < p.group; ++j) {
        const int h = hk * p.group + j;
        const Span span = column_span(p, b, h, tile_k);
        const float* lse_head = p.lse + b * p.lse_sb + h * p.lse_sh;
        const float* delta_head = p.delta + b * p.delta_sb + h * p.delta_sh;
        for (int i = 0; i < span.count; ++i, ++n) {
            const int2 e = p.col_entries[span.begin + i];
            const int q0 = e.x * TILE_M;
            const elem_t* q = sh.q[n % STAGES];
            const elem_t* dout = sh.dout[n % STAGES];
            if (n == 0) sh.kv_full.wait(0);
            sh.q_ring.wait(n);
            float st[TILE_M / 8][4], dpt[TILE_M / 8][4];  // S^T (64 keys x TILE_M queries), dP^T
            issue_ABt<TILE_M, TILE_N>(st, sh.k + keys * 64, q);
            issue_ABt<TILE_M, TILE_N>(dpt, sh.v + keys * 64, dout);

            // While the tensor cores run: the query tile's lse and delta into this consumer's buffer (queries
            // past the sequence and rows that attend to nothing get lse2 = +inf, so P = 0), and the mask.
            float(&vec)[2][TILE_M] = sh.vec[consumer][n & 1];
            for (int c = threadIdx.x % 128; c < TILE_M; c += 128) {
                const float lse = q0 + c < p.seq_q ? lse_head[q0 + c] : -INFINITY;
                vec[0][c] = lse == -INFINITY ? INFINITY : lse * LOG2E;
                vec[1][c] = q0 + c < p.seq_q ? delta_head[q0 + c] : 0.f;
            }
            const unsigned long long keep =
                mask_bits<true, TILE_M>(p, e.y, b, h, q0, k_tile0, keys + warp * 16, lane);
            warpgroup_sync(1 + consumer);  // the buffer is written; the one of use n - 1 stays until n + 1
            const float* lse2 = vec[0];
            const float* delta = vec[1];

            wgmma_wait<0>();
            fence_operands(st);
            fence_operands(dpt);
            apply_score_mod<true, TILE_M>(
                p, st, dpt, [&](int c, int jj) { return delta[c * 8 + 2 * t + (jj & 1)]; }, b, h,
                TilePos<true>(p, q0, k_tile0, keys + warp * 16, lane));
            if (e.y >= 0) apply_mask<TILE_M>(st, keep);
#pragma unroll
            for (int c = 0; c < TILE_M / 8; ++c)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
                    st[c][jj] = exp2f(fmaf(st[c][jj], scale_log2, -lse2[c * 8 + 2 * t + (jj & 1)]));  // P^T
            unsigned frag[TILE_M / 16][4];
            to_a_fragments<TILE_M>(st, frag);
            issue_PB<TILE_M>(dv, frag, dout);
            // dS^T while dV += P^T dO runs: P^T stays in st, its fragments in frag.
#pragma unroll
            for (int c = 0; c < TILE_M / 8; ++c)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
                    st[c][jj] = dscore(st[c][jj], dpt[c][jj], delta[c * 8 + 2 * t + (jj & 1)]);
            wgmma_wait<0>();
            fence_operands(dv);
            fence_operands(frag);
            to_a_fragments<TILE_M>(st, frag);
            issue_PB<TILE_M>(dk, frag, q);
            wgmma_wait<0>();
            fence_operands(dk);
            fence_operands(frag);
            sh.q_ring.release(n);
        }
    }

    const int row0 = k_tile0 + keys + warp * 16;
    const float one[2] = {1.f, 1.f}, scale[2] = {p.scale, p.scale};
    store_rows<HEAD_DIM>(dv, one, p.dv + b * p.dv_sb + hk * p.dv_sh, p.dv_ss, row0, p.seq_k, 0, lane);
    store_rows<HEAD_DIM>(dk, scale, p.dk + b * p.dk_sb + hk * p.dk_sh, p.dk_ss, row0, p.seq_k, 0, lane);
}
