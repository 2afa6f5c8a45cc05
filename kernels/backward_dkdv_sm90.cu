// Block-sparse flash attention, backward pass 2 of 2 for Hopper (sm_90a): dK and dV.
//
// One CTA per (key tile, key/value head, batch element), three warpgroups. The producer copies the K and V
// tiles once and streams the (Q, dO) tiles of the layout's column, for every query head of the group in turn,
// through a ring, with their rows' lse and delta (which the dQ pass wrote out): the consumers load nothing.
// Each consumer warpgroup owns 64 keys and works on transposed scores: S^T = K Q^T and dP^T = V dO^T from
// shared memory, P^T = exp(S^T - lse) and dS^T in registers, dV += P^T dO and dK += dS^T Q with both as
// register fragments and Q, dO read MN-major. Both are written once: no atomics, and the heads of a group add
// up in a fixed order, so two runs give the same bits. Keys no query attends to get zero gradients.
// float32 runs on TF32 tensor cores: dV += P^T dO and dK += dS^T Q read dO's and Q's transposed copies
// (hopper.cuh: B_TRANSPOSED), streamed through a second ring of T_STAGES buffers (tuning.transposed_stages),
// and a (Q, dO) slot goes back once its scores have landed.
#include "hopper.cuh"

using namespace csa;

static_assert(TILE_N == CONSUMERS * 64, "two 64-key consumers");
static_assert(TILE_M % 16 == 0 && TILE_M <= 256, "a query tile is one wgmma N");

// Overlapping a use's gradient products with the next one's scores keeps both sets of operands live: 64
// registers more a thread, which fit beside dK and dV at head dim 64 only.
constexpr bool PIPELINED = HEAD_DIM <= 64;
constexpr unsigned KV_BYTES = TILE_N * HEAD_DIM * sizeof(elem_t);
constexpr unsigned Q_BYTES = TILE_M * HEAD_DIM * sizeof(elem_t);
constexpr unsigned STAT_BYTES = TILE_M * sizeof(float);
static_assert(STAT_BYTES % 16 == 0, "bulk copies move whole 16-byte units");

struct alignas(1024) Shared {
    elem_t k[TILE_N * HEAD_DIM];
    elem_t v[TILE_N * HEAD_DIM];
    elem_t q[STAGES][TILE_M * HEAD_DIM];
    elem_t dout[STAGES][TILE_M * HEAD_DIM];
#if CSA_DTYPE_F32
    elem_t qt[T_STAGES][TILE_M * HEAD_DIM];  // [TILE_M / PANEL panels][HEAD_DIM][PANEL]
    elem_t dot[T_STAGES][TILE_M * HEAD_DIM];
#endif
    float stats[STAGES][2][TILE_M];  // the query tile's lse * log2(e) and delta (STAT_LSE2, STAT_DELTA)
    Barrier kv_full;
    Ring<STAGES> q_ring;  // Q, dO and their statistics
#if CSA_DTYPE_F32
    Ring<T_STAGES> t_ring;  // their transposed copies
#endif
};
static_assert(sizeof(Shared) + 1024 == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    csa_backward_dkdv_sm90(const __grid_constant__ Params p, const __grid_constant__ TensorMap q_map,
                           const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map,
                           const __grid_constant__ TensorMap do_map
#if CSA_DTYPE_F32
                           ,
                           const __grid_constant__ TensorMap qt_map, const __grid_constant__ TensorMap dot_map
#endif
    ) {
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
#if CSA_DTYPE_F32
        sh.t_ring.init(CONSUMERS * 128);
#endif
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        release_registers<24>();
        if (threadIdx.x == 0) {
            int n = 0;  // uses of the ring
            for (ColumnWalk<false> walk(p, b, hk, tile_k); !walk.done(); walk.next(), ++n) {
                if (n == 0) {
                    sh.kv_full.expect_bytes(2 * KV_BYTES);
                    tma_load_tile(sh.k, k_map, sh.kv_full, k_tile0, hk, b);
                    tma_load_tile(sh.v, v_map, sh.kv_full, k_tile0, hk, b);
                }
                const int q0 = walk.entry().x * TILE_M, h = walk.h(), slot = n % STAGES;
                Barrier& full = sh.q_ring.fill(n, 2 * Q_BYTES + 2 * STAT_BYTES);
                tma_load_tile(sh.q[slot], q_map, full, q0, h, b);
                tma_load_tile(sh.dout[slot], do_map, full, q0, h, b);
                // The dQ pass wrote the statistics over whole tiles of the padded length.
                bulk_load(sh.stats[slot][STAT_LSE2], stat_row(p, b, h, STAT_LSE2) + q0, STAT_BYTES, full);
                bulk_load(sh.stats[slot][STAT_DELTA], stat_row(p, b, h, STAT_DELTA) + q0, STAT_BYTES, full);
#if CSA_DTYPE_F32
                Barrier& t_full = sh.t_ring.fill(n, 2 * Q_BYTES);
                tma_load_rows<true>(sh.qt[n % T_STAGES], qt_map, t_full, q0, h, b);
                tma_load_rows<true>(sh.dot[n % T_STAGES], dot_map, t_full, q0, h, b);
#endif
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

    // Use n issues S^T_n = K Q_n^T and dP^T_n = V dO_n^T, then (PIPELINED) dV += P^T_{n-1} dO_{n-1} and
    // dK += dS^T_{n-1} Q_{n-1}, and forms P^T_n and dS^T_n while those run; unpipelined, the gradients of
    // n - 1 land before S^T_n is issued. Straight-line code around the waits keeps the products asynchronous.
    // Use n reads ring slot n % STAGES.
    float st[TILE_M / 8][4], dpt[TILE_M / 8][4];  // S^T (64 keys x TILE_M queries), dP^T
    unsigned p_frag[TILE_M / MMA_K][4], ds_frag[TILE_M / MMA_K][4];
    auto issue_scores_of = [&](int n) {
        sh.q_ring.wait(n);
        issue_ABt<TILE_M, TILE_N>(st, sh.k + keys * PANEL, sh.q[n % STAGES]);
        issue_ABt<TILE_M, TILE_N>(dpt, sh.v + keys * PANEL, sh.dout[n % STAGES]);
    };
    // P^T and dS^T of use n, in place of S^T and dP^T, once those have landed; with `behind`, the two gradient
    // products issued after them may still run (groups complete in order).
    auto gradients_of = [&](const ColumnWalk<false>& walk, int n, bool behind) {
        const int2 e = walk.entry();
        const int h = walk.h(), q0 = e.x * TILE_M;
        // The partial tile's mask is worked out while the tensor cores run.
        const auto keep = mask_bits<true, TILE_M>(p, e.y, b, h, q0, k_tile0, keys + warp * 16, lane);
        const float* lse2 = sh.stats[n % STAGES][STAT_LSE2];
        const float* delta = sh.stats[n % STAGES][STAT_DELTA];
        wgmma_wait_behind<2>(behind);
        fence_operands(st, dpt);
        transposed_scores_to_ds<TILE_M>(p, st, dpt, lse2, delta, e.y >= 0, keep, scale_log2, b, h,
                                        TilePos<true>(p, q0, k_tile0, keys + warp * 16, lane), t);
        if constexpr (B_TRANSPOSED) sh.q_ring.release(n);
    };
    auto to_fragments = [&] {
        to_a_fragments<TILE_M>(st, p_frag);
        to_a_fragments<TILE_M>(dpt, ds_frag);
    };
    auto issue_gradients_of = [&](int n) {
#if CSA_DTYPE_F32
        sh.t_ring.wait(n);
        issue_PB<TILE_M>(dv, p_frag, sh.dot[n % T_STAGES]);
        issue_PB<TILE_M>(dk, ds_frag, sh.qt[n % T_STAGES]);
#else
        issue_PB<TILE_M>(dv, p_frag, sh.dout[n % STAGES]);
        issue_PB<TILE_M>(dk, ds_frag, sh.q[n % STAGES]);
#endif
    };
    // Waits for dV and dK of use n and hands the ring slot they read back; the fragments are free again.
    auto finish_gradients_of = [&](int n) {
        wgmma_wait<0>();
        fence_operands(dv, dk, p_frag, ds_frag);
#if CSA_DTYPE_F32
        sh.t_ring.release(n);
#else
        sh.q_ring.release(n);
#endif
    };

    ColumnWalk<false> walk(p, b, hk, tile_k);
    if (!walk.done()) {
        sh.kv_full.wait(0);
        issue_scores_of(0);
        gradients_of(walk, 0, false);
        to_fragments();
        int n = 1;
        for (walk.next(); !walk.done(); walk.next(), ++n) {
            if constexpr (PIPELINED) {
                issue_scores_of(n);
                issue_gradients_of(n - 1);
            } else {
                issue_gradients_of(n - 1);
                finish_gradients_of(n - 1);
                issue_scores_of(n);
            }
            gradients_of(walk, n, PIPELINED);
            if constexpr (PIPELINED) finish_gradients_of(n - 1);
            to_fragments();
        }
        issue_gradients_of(n - 1);
        finish_gradients_of(n - 1);
    }

    const int row0 = k_tile0 + keys + warp * 16;
    const float one[2] = {1.f, 1.f}, scale[2] = {p.scale, p.scale};
    store_rows<HEAD_DIM>(dv, one, p.dv + b * p.dv_sb + hk * p.dv_sh, p.dv_ss, row0, p.seq_k, 0, lane);
    store_rows<HEAD_DIM>(dk, scale, p.dk + b * p.dk_sb + hk * p.dk_sh, p.dk_ss, row0, p.seq_k, 0, lane);
}
