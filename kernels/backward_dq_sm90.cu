// Block-sparse flash attention, backward pass 1 of 2 for Hopper (sm_90a): dQ, and pass 2's row statistics
// (common.cuh's row_stats). The structure of forward_sm90.cu: a producer warpgroup copies the Q and dO tiles
// once and streams the K and V tiles of the layout's row through two rings; each consumer warpgroup owns 64
// query rows, recomputes S = Q K^T and dP = dO V^T with both operands in shared memory, forms
// dS = P * (dP - delta) in registers and accumulates dQ += dS K with dS as register fragments and K read
// MN-major, overlapped with the next tile's dS. dQ is written once: no atomics, so two runs give the same bits.
// float32 runs on TF32 tensor cores: dQ += dS K reads K's transposed copy (hopper.cuh: B_TRANSPOSED), streamed
// through a third ring, and K's own tile goes back once S has landed.
#include "hopper.cuh"

using namespace csa;

static_assert(TILE_M == CONSUMERS * 64, "two 64-row consumers");
static_assert(TILE_N % 16 == 0 && TILE_N <= 256, "a key tile is one wgmma N");

constexpr unsigned Q_BYTES = TILE_M * HEAD_DIM * sizeof(elem_t);

constexpr unsigned KV_BYTES = TILE_N * HEAD_DIM * sizeof(elem_t);

struct alignas(1024) Shared {
    elem_t q[TILE_M * HEAD_DIM];
    elem_t dout[TILE_M * HEAD_DIM];
    elem_t k[STAGES][TILE_N * HEAD_DIM];
    elem_t v[STAGES][TILE_N * HEAD_DIM];
#if CSA_DTYPE_F32
    elem_t kt[STAGES][TILE_N * HEAD_DIM];  // [TILE_N / PANEL panels][HEAD_DIM][PANEL]
#endif
    Barrier q_full;  // Q and dO
    Ring<STAGES> k_ring, v_ring;
#if CSA_DTYPE_F32
    Ring<STAGES> kt_ring;
#endif
};
static_assert(sizeof(Shared) + 1024 == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    csa_backward_dq_sm90(const __grid_constant__ Params p, const __grid_constant__ TensorMap q_map,
                         const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map,
                         const __grid_constant__ TensorMap do_map
#if CSA_DTYPE_F32
                         ,
                         const __grid_constant__ TensorMap kt_map
#endif
    ) {
    extern __shared__ unsigned char smem_raw[];
    Shared& sh = aligned_shared<Shared>(smem_raw);
    if (threadIdx.x == 0 && dynamic_smem_size() < SHARED_BYTES) __trap();

    const int tile_q = query_tile(p);
    const int h = blockIdx.y, b = blockIdx.z;
    const Span span = row_span(p, b, h, tile_q);
    const int begin = span.begin, count = span.count;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        sh.q_full.init(1);
        sh.k_ring.init(CONSUMERS * 128);
        sh.v_ring.init(CONSUMERS * 128);
#if CSA_DTYPE_F32
        sh.kt_ring.init(CONSUMERS * 128);
#endif
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        release_registers<24>();
        if (threadIdx.x == 0 && count > 0) {
            sh.q_full.expect_bytes(2 * Q_BYTES);
            tma_load_tile(sh.q, q_map, sh.q_full, tile_q * TILE_M, h, b);
            tma_load_tile(sh.dout, do_map, sh.q_full, tile_q * TILE_M, h, b);
            for (int i = 0; i < count; ++i) {
                const int k0 = p.entries[begin + i].x * TILE_N, hk = h / p.group;
                tma_load_tile(sh.k[i % STAGES], k_map, sh.k_ring.fill(i, KV_BYTES), k0, hk, b);
                tma_load_tile(sh.v[i % STAGES], v_map, sh.v_ring.fill(i, KV_BYTES), k0, hk, b);
#if CSA_DTYPE_F32
                tma_load_rows<true>(sh.kt[i % STAGES], kt_map, sh.kt_ring.fill(i, KV_BYTES), k0, hk, b);
#endif
            }
        }
        return;
    }
    claim_registers<240>();

    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
    const int rows = (warpgroup - 1) * 64;  // this consumer's first row in the tile
    const int q_tile0 = tile_q * TILE_M, row0 = q_tile0 + rows + warp * 16;
    const float scale_log2 = softmax_scale(p) * LOG2E;
    float delta[2], lse2[2];
    row_stats(p, b, h, row0, lane, lse2, delta);

    float dq[HEAD_DIM / 8][4];
    zero(dq);
    // Step i issues S_i = Q K_i^T and dP_i = dO V_i^T, then dQ += dS_{i-1} K_{i-1}, and forms dS_i while the
    // last product runs (straight-line code around the waits keeps the products asynchronous).
    float s[TILE_N / 8][4], dp[TILE_N / 8][4];
    unsigned ds[TILE_N / MMA_K][4];
    auto issue_scores_of = [&](int i) {
        sh.k_ring.wait(i);
        issue_ABt<TILE_N, TILE_M>(s, sh.q + rows * PANEL, sh.k[i % STAGES]);
        sh.v_ring.wait(i);
        issue_ABt<TILE_N, TILE_M>(dp, sh.dout + rows * PANEL, sh.v[i % STAGES]);
    };
    // dQ += dS_i K_i, once K_i's tile (or its transposed copy's) has landed.
    auto issue_dq_of = [&](int i) {
#if CSA_DTYPE_F32
        sh.kt_ring.wait(i);
        issue_PB<TILE_N>(dq, ds, sh.kt[i % STAGES]);
#else
        issue_PB<TILE_N>(dq, ds, sh.k[i % STAGES]);
#endif
    };
    // dS_i into ds once S_i and dP_i have landed; with `behind`, the dQ product issued after them may still
    // run (groups complete in order).
    auto ds_of = [&](int i, bool behind) {
        const int2 e = p.entries[begin + i];
        const int k0 = e.x * TILE_N;
        // The partial tile's mask is worked out while the tensor cores run.
        const auto keep = mask_bits<false, TILE_N>(p, e.y, b, h, q_tile0, k0, rows + warp * 16, lane);
        wgmma_wait_behind(behind);
        fence_operands(s, dp);
        sh.v_ring.release(i);
        if constexpr (B_TRANSPOSED) sh.k_ring.release(i);
        apply_score_mod<false, TILE_N>(
            p, s, dp, [&](int, int j) { return delta[j >> 1]; }, b, h,
            TilePos<false>(p, q_tile0, k0, rows + warp * 16, lane));
        if (e.y >= 0) apply_mask<TILE_N>(s, keep);
        scores_to_ds<TILE_N>(s, dp, lse2, delta, scale_log2);
    };
    // Waits for dQ += dS_i K_i and hands the buffer it read back; ds is free again.
    auto finish_dq_of = [&](int i) {
        wgmma_wait<0>();
        fence_operands(dq, ds);
#if CSA_DTYPE_F32
        sh.kt_ring.release(i);
#else
        sh.k_ring.release(i);
#endif
    };

    if (count > 0) {
        sh.q_full.wait(0);
        issue_scores_of(0);
        ds_of(0, false);
        to_a_fragments<TILE_N>(s, ds);
        for (int i = 1; i < count; ++i) {
            issue_scores_of(i);
            issue_dq_of(i - 1);  // reads dS_{i-1} from ds while S_i goes to s
            ds_of(i, true);
            finish_dq_of(i - 1);
            to_a_fragments<TILE_N>(s, ds);
        }
        issue_dq_of(count - 1);
        finish_dq_of(count - 1);
    }
    const float factor[2] = {p.scale, p.scale};
    store_rows<HEAD_DIM>(dq, factor, p.dq + b * p.dq_sb + h * p.dq_sh, p.dq_ss, row0, p.seq_q, 0, lane);
}
