// Block-sparse flash attention, the whole backward for Hopper (sm_90a) in one pass: dK, dV and dQ, after the
// row statistics (lse * log2(e) and delta = rowsum(dO * O)) are in the scratch (backward_stats.cu).
//
// Persistent: a CTA walks its items of the schedule (schedule.column_schedule; entries blockIdx.x,
// blockIdx.x + gridDim.x, ... up to a -1): every (batch element, key/value head, key tile), visiting the
// column of each query head of the group in turn, each column from its diagonal on. Three warpgroups.
// - Warp 0 of the producer copies an item's K and V tiles once and streams each visit's Q, dO and statistics
//   through a ring.
// - Each consumer warpgroup owns 64 keys: S^T = K Q^T and dP^T = V dO^T, P^T and dS^T in registers,
//   dV += P^T dO and dK += dS^T Q (as backward_dkdv_sm90.cu does), and dS^T stored transposed as its half of
//   a shared dS tile. Then the visit's share of dQ, dS K over the tile's keys: each consumer takes half the
//   head dim (128: visits of 64 queries) or half the queries (64: visits of 128, as FlashAttention-3/4), or
//   the consumers take the visits in turn (64 with a score mod: visits of 64). The share goes to a shared
//   fp32 buffer.
// - Two adding threads (warps 1 and 2 of the producer, the even and the odd visits) add those shares into the
//   query tile's fp32 sum in the scratch by bulk TMA reductions, in the order the schedule ranks the adds into
//   each query tile (add_share: one CTA at a time, so the same bits every run), or as they come
//   (p.dq_unordered). An ordered add waits for its reduction to land before the next add may start: two
//   adders keep two in flight, to different query tiles. backward_dq_convert.cu then scales the sums and
//   rounds them to the element type.
// dK and dV are written once per item, staged in shared memory and copied out by TMA. Five products per visit,
// against seven for the dQ and dK/dV passes.
#include "hopper.cuh"

using namespace csa;

static_assert(TILE_N == CONSUMERS * 64, "two 64-key consumers");
static_assert(TILE_M == 64 || TILE_M == 128, "a visit's dS is one or two 64-row wgmma A tiles");

constexpr unsigned KV_BYTES = TILE_N * HEAD_DIM * sizeof(elem_t);
constexpr unsigned Q_BYTES = TILE_M * HEAD_DIM * sizeof(elem_t);
constexpr unsigned STAT_BYTES = TILE_M * sizeof(float);
constexpr int DS_BAR = 3;  // a named barrier of the consumers (1 and 2 are their turns in the other passes)
// A visit's share of dQ in 64 x 64 blocks (query rows by head-dim columns): one for each consumer (64 queries
// at head dim 128: half the columns each; 128 queries at 64: half the rows each), or one that the consumers
// take in turn (64 queries at 64).
constexpr int DQ_N = 64, DQ_BLOCKS = TILE_M / 64 * (HEAD_DIM / DQ_N);
static_assert(DQ_BLOCKS == 1 || DQ_BLOCKS == CONSUMERS, "a block of dQ for each consumer, or one in turn");
// Two dS tiles, so that a consumer may store the next visit's half while the other's dQ product still reads
// this one: the consumers meet once a visit, when both halves are in.
constexpr int DS_BUFFERS = 2;
// A partial visit's mask: at 64 queries its bits are worked out while the products run; at 128 they spill
// beside the scores, and P^T and dS^T are zeroed where it hides them once they are made.
constexpr bool LATE_MASK = TILE_M == 128;
// One K/V buffer: K and V go back to the producer before dK and dV are out (the end of the item loop).
constexpr bool KV_FIRST = KV_BUFFERS == 1;

// A visit as the loading thread works it out when it issues the visit's copies: the adding threads keep no
// walk of their own, and the consumers read its entry from shared memory (from global memory, it stalled the
// issue of their products: each ordered add's acquire invalidates the SM's L1). head < 0: no more visits.
struct Visit {
    int head;  // b * heads_q + h: with the entry's query tile, where its sum and counter are (dq_sum)
    int rank;
    int2 entry;  // its layout entry: query tile, mask
};
// The loading thread writes visit n once the consumers have released visit n - 1 - STAGES, and a consumer
// releases visit m once the add of m - 2 has landed; the loading thread ends with one head < 0 for each adding
// thread: a ring of STAGES + 5 is never overwritten while read.
constexpr int VISITS = 8, ADDERS = 2;
static_assert(VISITS >= STAGES + 5, "the ring of visits holds those not yet read");
// Adding thread a (lane 0 of the producer's warp a + 1) takes visits a, a + ADDERS, ...: each owns one of the
// two dQ share buffers (n % 2), whose barriers it waits on in phase order.
static_assert(ADDERS == 2, "one adding thread per dQ share buffer");
// setmaxnreg moves registers within the CTA's allocation, 168 a thread (65536 / 384 down to a multiple of 8):
// claims past it wait forever. The loading thread walks the schedule and works out the adds, which spill
// at 24 registers; the consumers fit 232.
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= 3 * 168, "the register file holds the claims");

// KV_BUFFERS (the builder's, 2 where shared memory holds them): the item after next's K and V may be copied
// while an item runs, and the Q and dO of its first visits behind them.
struct alignas(1024) Shared {
    elem_t k[KV_BUFFERS][TILE_N * HEAD_DIM];
    elem_t v[KV_BUFFERS][TILE_N * HEAD_DIM];
    elem_t q[STAGES][TILE_M * HEAD_DIM];
    elem_t dout[STAGES][TILE_M * HEAD_DIM];
    elem_t ds[DS_BUFFERS][TILE_M * TILE_N];  // dS of a visit: [key panel][query][64 keys], swizzled
    float dq_part[2][TILE_M * HEAD_DIM];  // the visit's share of dQ, as dq_sum lays it out
    float stats[STAGES][2][TILE_M];       // lse * log2(e) and delta of the visit's rows
    Visit visit[VISITS];                  // the visits ahead, for the consumers and the adding threads
    Barrier kv_full[KV_BUFFERS], kv_empty[KV_BUFFERS];  // K and V of an item; released once dK and dV are out
    Barrier part_full[2], part_empty[2];  // dq_part: written by the consumers, added by an adding thread
    Barrier visit_full[VISITS];           // visit[i]: written
    Ring<STAGES> q_ring;                  // Q, dO and their statistics
};
// With visits of 128 queries it fills the 227 KiB: it starts at the start of dynamic shared memory
// (shared_at_start), and the builder launches with sizeof(Shared).
static_assert(sizeof(Shared) == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

// The CTA's w-th item of the schedule, or none (-1) past its last. Producer, consumers and writers all walk
// its visits (ColumnWalk<true>), and so agree on every buffer and barrier phase.
__device__ __forceinline__ int item_at(const Params& p, int w) { return w < p.work_count ? p.work[w] : -1; }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    csa_backward_sm90(const __grid_constant__ Params p, const __grid_constant__ TensorMap q_map,
                      const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map,
                      const __grid_constant__ TensorMap do_map, const __grid_constant__ TensorMap dk_map,
                      const __grid_constant__ TensorMap dv_map) {
    extern __shared__ unsigned char smem_raw[];
    Shared& sh = shared_at_start<Shared>(smem_raw);
    if (threadIdx.x == 0 && dynamic_smem_size() < SHARED_BYTES) __trap();
    const int warpgroup = uniform_warpgroup();  // its K and V panels' descriptors uniform: descriptor_add64

    if (threadIdx.x == 0) {
        for (int s = 0; s < KV_BUFFERS; ++s) {
            sh.kv_full[s].init(1);
            sh.kv_empty[s].init(CONSUMERS);
        }
        for (int s = 0; s < 2; ++s) {
            sh.part_full[s].init(CONSUMERS * 128);
            sh.part_empty[s].init(1);
        }
        for (int s = 0; s < VISITS; ++s) sh.visit_full[s].init(1);
        sh.q_ring.init(CONSUMERS * 128);
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        release_registers<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            int n = 0;  // visits so far: uses of the ring
            for (int w = blockIdx.x, items = 0;; w += gridDim.x, ++items) {
                ColumnWalk<true> visits(p, item_at(p, w));
                if (visits.b < 0) break;
                // The consumers are done with the buffer's last item.
                const int kv = items % KV_BUFFERS;
                sh.kv_empty[kv].wait(((items / KV_BUFFERS) & 1) ^ 1);
                sh.kv_full[kv].expect_bytes(2 * KV_BYTES);
                tma_load_tile(sh.k[kv], k_map, sh.kv_full[kv], visits.tile_k * TILE_N, visits.hk, visits.b);
                tma_load_tile(sh.v[kv], v_map, sh.kv_full[kv], visits.tile_k * TILE_N, visits.hk, visits.b);
                for (; !visits.done(); visits.next(), ++n) {
                    const int2 e = visits.entry();
                    const int q0 = e.x * TILE_M, h = visits.h(), b = visits.b;
                    sh.visit[n % VISITS] = {b * p.heads_q + h, visits.rank(), e};
                    sh.visit_full[n % VISITS].arrive();
                    const int slot = n % STAGES;
                    Barrier& full = sh.q_ring.fill(n, 2 * Q_BYTES + 2 * STAT_BYTES);
                    tma_load_tile(sh.q[slot], q_map, full, q0, h, b);
                    tma_load_tile(sh.dout[slot], do_map, full, q0, h, b);
                    bulk_load(sh.stats[slot][STAT_LSE2], stat_row(p, b, h, STAT_LSE2) + q0, STAT_BYTES, full);
                    bulk_load(sh.stats[slot][STAT_DELTA], stat_row(p, b, h, STAT_DELTA) + q0, STAT_BYTES, full);
                }
            }
            for (int a = 0; a < ADDERS; ++a, ++n) {
                sh.visit[n % VISITS].head = -1;
                sh.visit_full[n % VISITS].arrive();
            }
        } else if (threadIdx.x % 32 == 0 && threadIdx.x / 32 <= ADDERS) {
            for (int n = threadIdx.x / 32 - 1;; n += ADDERS) {
                sh.visit_full[n % VISITS].wait((n / VISITS) & 1);
                const Visit add = sh.visit[n % VISITS];
                if (add.head < 0) break;
                sh.part_full[n % 2].wait((n / 2) & 1);
                const int b = add.head / p.heads_q, h = add.head % p.heads_q, tile_q = add.entry.x;
                add_share(dq_sum(p, b, h, tile_q), sh.dq_part[n % 2], sizeof(sh.dq_part[0]),
                          dq_counters(p, b, h) + tile_q, add.rank, !p.dq_unordered);
                sh.part_empty[n % 2].arrive();
            }
        }
        return;
    }
    claim_registers<CONSUMER_REGS>();

    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31, t = lane & 3, g = lane >> 2;
    const int keys = consumer * 64;  // this consumer's first key in the tile
    const float scale_log2 = softmax_scale(p) * LOG2E;
    float st[TILE_M / 8][4], dpt[TILE_M / 8][4];  // S^T (64 keys x TILE_M queries), dP^T
    unsigned p_frag[TILE_M / 16][4], ds_frag[TILE_M / 16][4];
    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM / 8][4], dq[DQ_N / 8][4];

    int n = 0;
    for (int items = 0;; ++items) {  // the item's index from one counter: with two, NVRTC's code spilled
        ColumnWalk<true> visits(p, item_at(p, blockIdx.x + items * gridDim.x));
        if (visits.b < 0) break;
        const int b = visits.b, k_tile0 = visits.tile_k * TILE_N;
        zero(dk);
        zero(dv);
        const int kv = items % KV_BUFFERS, first = n;
        const elem_t* k_tile = sh.k[kv];
        sh.kv_full[kv].wait((items / KV_BUFFERS) & 1);
        for (bool more = !visits.done(); more; ++n) {
            sh.visit_full[n % VISITS].wait((n / VISITS) & 1);
            const int2 e = sh.visit[n % VISITS].entry;
            const int h = visits.h(), q0 = e.x * TILE_M, slot = n % STAGES, buf = n % 2, ds = n % DS_BUFFERS;
            sh.q_ring.wait(n);
            issue_ABt<TILE_M, TILE_N>(st, k_tile + keys * 64, sh.q[slot]);
            issue_ABt<TILE_M, TILE_N>(dpt, sh.v[kv] + keys * 64, sh.dout[slot]);
            // The partial visit's mask bits: before its scores land, or (LATE_MASK) once P^T and dS^T are made.
            auto visit_mask = [&] {
                return mask_bits<true, TILE_M>(p, e.y, b, h, q0, k_tile0, keys + warp * 16, lane);
            };
            ElementBits<TILE_M> keep;
            if (!LATE_MASK) keep = visit_mask();
            const float* lse2 = sh.stats[slot][STAT_LSE2];
            const float* delta = sh.stats[slot][STAT_DELTA];
            // S^T lands first: P^T is made while dP^T's product runs (not with a score mod, whose derivative
            // needs both).
            const bool partial = !LATE_MASK && e.y >= 0;
            wgmma_wait<1>();
            fence_operands(st);
            if (!SCORE_MOD) transposed_probs<TILE_M>(st, lse2, partial, keep, scale_log2, t);
            wgmma_wait<0>();
            fence_operands(dpt);
            if (SCORE_MOD)
                transposed_scores_to_ds<TILE_M>(p, st, dpt, lse2, delta, partial, keep, scale_log2, b, h,
                                                TilePos<true>(p, q0, k_tile0, keys + warp * 16, lane), t);
            else
                transposed_ds<TILE_M>(st, dpt, delta, t);
            if (LATE_MASK && e.y >= 0) zero_hidden<TILE_M>(st, dpt, visit_mask());
            to_a_fragments<TILE_M>(st, p_frag);
            to_a_fragments<TILE_M>(dpt, ds_frag);
            // dS^T's 64 keys become this consumer's panel of dS; both halves are in before either reads them.
            store_transposed<TILE_M>(ds_frag, sh.ds[ds] + consumer * TILE_M * 64);
            // dV's product needs this consumer's P^T alone: it runs while the other half of dS comes.
            issue_PB<TILE_M>(dv, p_frag, sh.dout[slot]);
            fence_stores_for_async();
            named_barrier(DS_BAR, CONSUMERS * 128);
            // dQ's share: query rows [dq_row, dq_row + 64) by head-dim columns [dq_col, dq_col + 64), by this
            // consumer on this visit or not at all. It is issued before dK's product, and goes out to its adding
            // thread while that one runs.
            const bool mine = DQ_BLOCKS == CONSUMERS || (n & 1) == consumer;
            const int block = DQ_BLOCKS == CONSUMERS ? consumer : 0;
            const int dq_row = block / (HEAD_DIM / DQ_N) * 64, dq_col = block % (HEAD_DIM / DQ_N) * DQ_N;
            if (mine)
                issue_AB<DQ_N, TILE_N, TILE_M, TILE_N>(dq, sh.ds[ds] + dq_row * 64, k_tile + dq_col * TILE_N);
            issue_PB<TILE_M>(dk, ds_frag, sh.q[slot]);
            sh.part_empty[buf].wait(((n / 2) & 1) ^ 1);
            wgmma_wait<1>();
            fence_operands(dq);
            if (mine) {
                float* part = sh.dq_part[buf];
#pragma unroll
                for (int c = 0; c < DQ_N / 8; ++c)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = dq_row + warp * 16 + g + 8 * r, chunk = dq_col / 8 + c;
                        *reinterpret_cast<float2*>(part + (chunk * TILE_M + row) * 8 + 2 * t) =
                            make_float2(dq[c][2 * r], dq[c][2 * r + 1]);
                    }
                fence_stores_for_async();  // for the bulk reduction that reads them
            }
            sh.part_full[buf].arrive();
            wgmma_wait<0>();
            fence_operands(dv, dk, p_frag, ds_frag);
            if (!KV_FIRST) sh.q_ring.release(n);
            visits.next();
            more = !visits.done();
            if (KV_FIRST && more) sh.q_ring.release(n);  // the item's last slot is held: dK is staged there
        }
        // Both consumers' last products are in (the other's dQ read this one's keys): each stages its dV and dK
        // as 64-row tiles, and one thread copies them out by TMA. With two K/V buffers (head dim 64, visits of 64
        // queries) they are staged in this consumer's halves of the item's K and V tiles, released once the
        // copies have read them (the warpgroup goes on meanwhile: the next item's K and V are in the other
        // buffer). With one (KV_FIRST: head dim 128, or visits of 128 queries) the next item's copies would wait
        // for that read: K and V go back at once, and the tiles are staged in the dS tiles and the item's last
        // Q or dO tile (its slot held), which go back once both consumers' copies have read them; an item
        // without visits writes zeros from one tile. At head dim 64 with visits of 64 the tiles stay in K and V:
        // there KV_FIRST's end-of-item barriers and held slot only cost (docs/tuning.md: KV_FIRST).
        named_barrier(DS_BAR, CONSUMERS * 128);
        if (KV_FIRST && threadIdx.x % 128 == 0) sh.kv_empty[kv].arrive();
        const bool visited = n > first;
        const int last = (n + STAGES - 1) % STAGES;  // the slot of visit n - 1
        elem_t* dv_tile = (KV_FIRST ? sh.ds[0] : sh.v[kv]) + consumer * 64 * HEAD_DIM;
        elem_t* dk_tile = !KV_FIRST  ? sh.k[kv] + consumer * 64 * HEAD_DIM
                          : !visited ? dv_tile
                          : consumer == 0 ? sh.q[last]
                                          : sh.dout[last];
        store_tile(dv, 1.f, dv_tile);
        if (!KV_FIRST || visited) store_tile(dk, p.scale, dk_tile);
        fence_stores_for_async();
        named_barrier(DS_BAR, CONSUMERS * 128);
        if (threadIdx.x % 128 == 0) {
            tma_store_tile(dv_map, dv_tile, k_tile0 + keys, visits.hk, b);
            tma_store_tile(dk_map, dk_tile, k_tile0 + keys, visits.hk, b);
            bulk_commit();
            bulk_wait_read();
            if (!KV_FIRST) sh.kv_empty[kv].arrive();
        }
        if (KV_FIRST) {
            named_barrier(DS_BAR, CONSUMERS * 128);
            if (visited) sh.q_ring.release(n - 1);
        }
    }
}
