// Block-sparse flash attention, forward pass for Hopper (sm_90a): TMA copies, warpgroup MMAs and a producer
// warpgroup that only loads.
//
// Persistent: one CTA per SM walks its part of the schedule (plan.work_order: every (batch element, query
// head, query tile), dealt heaviest row first to the CTA that would be free first), entries blockIdx.x,
// blockIdx.x + gridDim.x, ... up to a -1. Three warpgroups. The producer gives most of its registers to the
// others; one of its threads copies each item's Q tile into a ring of two, then the K and V tiles that the
// layout's row lists into two rings of STAGES buffers (hopper.cuh's Ring); the rings run on across items. K_i
// is released once S_i has landed, a step before V_i, so the next K copy starts early, and Q once the row's
// last S has landed; the next item's Q is copied while this one runs. Each consumer warpgroup owns 64 query
// rows: S = Q K^T from shared memory, then the mask, score mod and online softmax of the mma.sync kernel (a
// warp holds its accumulators alike), then O += P V with P from registers, overlapped with the next tile's
// softmax. The two consumers take turns to issue their products, so that one's softmax overlaps the other's
// matrix products. Writes out [B, Hq, Sq, D] and lse [B, Hq, Sq] as forward.cu does.
#include "hopper.cuh"

using namespace csa;

static_assert(TILE_M == CONSUMERS * 64, "two 64-row consumers");
static_assert(TILE_N % 16 == 0 && TILE_N <= 256, "a key tile is one wgmma N");

constexpr unsigned Q_BYTES = TILE_M * HEAD_DIM * sizeof(elem_t);
// Two Q buffers: the next item's Q is copied while this one runs, which short rows (a narrow window) notice.
constexpr int Q_STAGES = 2;

struct alignas(1024) Shared {
    elem_t q[Q_STAGES][TILE_M * HEAD_DIM];
    elem_t k[STAGES][TILE_N * HEAD_DIM];
    elem_t v[STAGES][TILE_N * HEAD_DIM];
    Ring<Q_STAGES> q_ring;
    Ring<STAGES> k_ring, v_ring;
};
// The builder launches with sizeof(Shared) and 1024 bytes to align it: dynamic shared memory is only
// guaranteed 16-byte alignment.
static_assert(sizeof(Shared) + 1024 == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    csa_forward_sm90(const __grid_constant__ Params p, const __grid_constant__ TensorMap q_map,
                     const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map) {
    extern __shared__ unsigned char smem_raw[];
    Shared& sh = aligned_shared<Shared>(smem_raw);
    if (threadIdx.x == 0 && dynamic_smem_size() < SHARED_BYTES) __trap();
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        sh.q_ring.init(CONSUMERS * 128);
        sh.k_ring.init(CONSUMERS * 128);
        sh.v_ring.init(CONSUMERS * 128);
        fence_barrier_init();
    }
    __syncthreads();

    // Both roles count the items with a row (`rows_done`: uses of the Q ring) and the K/V tiles so far
    // (`uses`: uses of the rings), and so agree on every buffer and barrier phase.
    if (warpgroup == 0) {
        release_registers<24>();
        if (threadIdx.x == 0) {
            int rows_done = 0, uses = 0;
            for (int w = blockIdx.x; w < p.work_count && p.work[w] >= 0; w += gridDim.x) {
                const WorkItem t = work_item(p, p.work[w], p.tiles_q);
                const Span span = row_span(p, t.b, t.h, t.tile);
                if (span.count == 0) continue;
                tma_load_tile(sh.q[rows_done % Q_STAGES], q_map, sh.q_ring.fill(rows_done, Q_BYTES), t.tile * TILE_M,
                              t.h, t.b);
                ++rows_done;
                stream_kv<TILE_N>(p, span, t.h / p.group, t.b, sh.k, sh.v, k_map, v_map, sh.k_ring, sh.v_ring,
                                  uses);
                uses += span.count;
            }
        }
        return;
    }
    claim_registers<240>();

    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
    const int consumer = warpgroup - 1, rows = consumer * 64;  // rows: this consumer's first row in the tile
    int rows_done = 0, uses = 0;
    for (int w = blockIdx.x; w < p.work_count && p.work[w] >= 0; w += gridDim.x) {
        const WorkItem t = work_item(p, p.work[w], p.tiles_q);
        const int b = t.b, h = t.h, q_tile0 = t.tile * TILE_M;
        const Span span = row_span(p, b, h, t.tile);
        const int begin = span.begin, count = span.count;
        float o[HEAD_DIM / 8][4];
        zero(o);
        OnlineSoftmax sm;
        sm.init();
        // Step i issues S_i = Q K_i^T, then O += P_{i-1} V_{i-1}, and runs the softmax of S_i while the second
        // product is in flight; the output is rescaled once that product has landed. Straight-line code around
        // the waits lets ptxas keep the products asynchronous. Ring use of step i: uses + i.
        float sc[TILE_N / 8][4];
        unsigned pa[TILE_N / 16][4];
        float alpha[2];
        auto issue_scores_of = [&](int i) {
            sh.k_ring.wait(uses + i);
            issue_ABt<TILE_N, TILE_M>(sc, sh.q[rows_done % Q_STAGES] + rows * 64, sh.k[(uses + i) % STAGES]);
        };
        auto issue_output_of = [&](int i) {
            sh.v_ring.wait(uses + i);
            issue_PB<TILE_N>(o, pa, sh.v[(uses + i) % STAGES]);
        };
        // Masks, mods and exponentiates S_i once it has landed; with `behind`, one product issued after S_i
        // (groups complete in order) may still run.
        auto softmax_of = [&](int i, bool behind) {
            const int2 e = p.entries[begin + i];
            const int k0 = e.x * TILE_N;
            // The partial tile's mask is worked out while the tensor cores run.
            const unsigned long long keep =
                mask_bits<false, TILE_N>(p, e.y, b, h, q_tile0, k0, rows + warp * 16, lane);
            wgmma_wait_behind(behind);
            fence_operands(sc);
            sh.k_ring.release(uses + i);
            if (i == count - 1) sh.q_ring.release(rows_done);  // the row's last use of Q
            apply_score_mod<false, TILE_N>(p, sc, b, h, TilePos<false>(p, q_tile0, k0, rows + warp * 16, lane));
            if (e.y >= 0) apply_mask<TILE_N>(sc, keep);
            sm.step(sc, softmax_scale(p), alpha);
        };
        // Waits for O += P_i V_i and hands V_i's buffer back to the producer; pa is free again.
        auto finish_output_of = [&](int i) {
            wgmma_wait<0>();
            fence_operands(o);
            fence_operands(pa);
            sh.v_ring.release(uses + i);
        };

        // The consumers take turns to issue (ping-pong): consumer 0 first, and the last turn of consumer 1 is
        // not passed on, so every wait meets exactly one arrival, item after item.
        if (count > 0) {
            sh.q_ring.wait(rows_done);
            if (consumer == 1) pass_turn(consumer);
            take_turn(consumer);
            issue_scores_of(0);
            pass_turn(consumer);
            softmax_of(0, false);  // the output is still zero: nothing to rescale
            to_a_fragments<TILE_N>(sc, pa);
            for (int i = 1; i < count; ++i) {
                take_turn(consumer);
                issue_scores_of(i);
                issue_output_of(i - 1);  // reads P_{i-1} from pa while S_i goes to sc
                pass_turn(consumer);
                softmax_of(i, true);
                finish_output_of(i - 1);
                OnlineSoftmax::rescale(o, alpha);
                to_a_fragments<TILE_N>(sc, pa);
            }
            take_turn(consumer);
            issue_output_of(count - 1);
            if (consumer == 0) pass_turn(consumer);
            finish_output_of(count - 1);
            ++rows_done;
            uses += count;
        }
        finish_rows(p, sm, o, b, h, q_tile0 + rows + warp * 16, lane);
    }
}
