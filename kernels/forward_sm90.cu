// Block-sparse flash attention, forward pass for Hopper (sm_90a): TMA copies, warpgroup MMAs and a producer
// warpgroup that only loads.
//
// Persistent: one CTA per SM walks its part of the schedule (schedule.work_order: every (batch element, query
// head, query tile), dealt heaviest row first to the CTA that would be free first), entries blockIdx.x,
// blockIdx.x + gridDim.x, ... up to a -1, each item's row read a step ahead (Walk). A producer warpgroup
// and one consumer warpgroup for each 64 query rows: two, or three at head dim 64, whose softmax takes as
// long as its products; key tiles of 128, or 192 at head dim 128, fewer steps for the same products. Those
// wide tiles (tuning.WIDE_TILES) run where the host finds that they pay (cuda._wide_pays). The producer
// gives most of its registers to the others; one of its threads copies each item's Q tile into a ring of
// Q_BUFFERS, then the K and V tiles that the layout's row lists into two rings (hopper.cuh's Ring), each K
// tile before the V tile of the entry before it, as the consumers wait for them; the
// rings run on across items. K_i is released once S_i has landed, a step before V_i, so the next K copy
// starts early, and Q once the row's last S has landed, or once out has been stored from it (STAGE_OUT);
// with two Q buffers the next item's Q is copied while this one runs. Each consumer warpgroup owns 64 query
// rows: S = Q K^T from shared memory, then the mask, score mod and online softmax of the mma.sync kernel (a
// warp holds its accumulators alike), then O += P V with P from registers, overlapped with the next tile's
// softmax. The consumers take turns to issue their products, so that one's softmax overlaps the others'
// matrix products. Items run on into each other: a row's last O += P V is issued with the next row's first S, and
// the row is written out while that S is in flight, so that short rows (narrow windows, S = 4096) keep the
// tensor cores busy. Writes out [B, Hq, Sq, D] (o_map: tiles of 64 rows) and lse [B, Hq, Sq] as forward.cu
// does. With SPLIT_ROWS, the deal's last rows may come as parts of their entries, dealt to several CTAs so
// that no SM waits for a last round of few rows (schedule.work_order): a part's lse and out = acc / l go to its
// slot of the scratch in fp32 (store_part), and forward_combine.cu then writes those rows. float32 runs on TF32
// tensor cores, V read from its transposed copy (hopper.cuh: B_TRANSPOSED), which transpose.cu makes first.
#include "hopper.cuh"

using namespace csa;

static_assert(TILE_M == CONSUMERS * 64, "a consumer warpgroup for each 64 query rows");
static_assert(TILE_N % 16 == 0 && TILE_N <= 256, "a key tile is one wgmma N");

constexpr unsigned Q_BYTES = TILE_M * HEAD_DIM * sizeof(elem_t);
// STAGE_OUT (tuning.forward_stage_out; two Q buffers): a consumer writes its rows of out into its rows of the
// row's Q buffer, which a TMA store copies out while the next row runs, and the buffer goes back once the
// store has read it. Written from registers, each store of 4-byte pieces of 8 rows passes through L1 eight
// times while the consumers' row ends hold the tensor cores idle. With one Q buffer the next row's Q waits in
// it: the rows are written from registers.
static_assert(!STAGE_OUT || Q_BUFFERS > 1, "out is staged in one Q buffer while the next row's Q is in the other");
static_assert(!STAGE_OUT || sizeof(elem_t) == 2, "out is staged by stmatrix, in 16-bit elements");
// Q_ROWS (tuning.forward_q_rows, also the q map's box): the rows of each Q copy, laid out as [HEAD_DIM / PANEL
// panels][Q_ROWS rows][PANEL]; a consumer's 64 where out is staged, so that its rows are the 64-row tile that
// o_map's stores read.
static_assert((Q_ROWS == 64 || Q_ROWS == TILE_M) && (!STAGE_OUT || Q_ROWS == 64),
              "a Q copy is a consumer's rows or the whole tile, and a consumer's where out is staged");
// Named barriers: 1 to CONSUMERS are the turns (hopper.cuh); OUT_BAR + consumer holds a consumer's threads
// until its rows of out are in shared memory.
constexpr int OUT_BAR = CONSUMERS + 1;
// Q_BUFFERS (tuning.forward_q_buffers): two, so that the next item's Q is copied while this one runs, which
// short rows (a narrow window) notice; one beside key tiles of 192 (head dim 128), whose two K and two V
// buffers fill the rest. K takes STAGES buffers, V V_STAGES (tuning.forward_v_stages: three with key tiles of
// 128 at head dim 128, as V is held a step longer than K).
// setmaxnreg moves registers within what the CTA was launched with, 65536 / THREADS a thread in whole 8s (168
// beside two consumers, 128 beside three): a claim beyond what the producer frees never returns. The producer
// keeps 24 and the consumers share the rest, 240 each of two or 160 each of three.
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
constexpr int PRODUCER_REGS = 24,
              CONSUMER_REGS = (LAUNCH_REGS * THREADS / 128 - PRODUCER_REGS) / CONSUMERS / 8 * 8;
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (CONSUMERS + 1) * LAUNCH_REGS,
              "the consumers claim no more than the producer frees");

struct alignas(1024) Shared {
    elem_t q[Q_BUFFERS][TILE_M * HEAD_DIM];
    elem_t k[STAGES][TILE_N * HEAD_DIM];
    elem_t v[V_STAGES][TILE_N * HEAD_DIM];  // B_TRANSPOSED: [TILE_N / PANEL panels][HEAD_DIM][PANEL]
    Ring<Q_BUFFERS> q_ring;
    Ring<STAGES> k_ring;
    Ring<V_STAGES> v_ring;
};
// The builder launches with sizeof(Shared) and 1024 bytes to align it: dynamic shared memory is only
// guaranteed 16-byte alignment.
static_assert(sizeof(Shared) + 1024 == SHARED_BYTES, "the builder launches with the kernel's shared memory size");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    csa_forward_sm90(const __grid_constant__ Params p, const __grid_constant__ TensorMap q_map,
                     const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map,
                     const __grid_constant__ TensorMap o_map) {
    extern __shared__ unsigned char smem_raw[];
    Shared& sh = aligned_shared<Shared>(smem_raw);
    if (threadIdx.x == 0 && dynamic_smem_size() < SHARED_BYTES) __trap();
    const int warpgroup = uniform_warpgroup();

    if (threadIdx.x == 0) {
        sh.q_ring.init(STAGE_OUT ? CONSUMERS : CONSUMERS * 128);  // staged: a thread of each consumer
        sh.k_ring.init(CONSUMERS * 128);
        sh.v_ring.init(CONSUMERS * 128);
        fence_barrier_init();
    }
    __syncthreads();

    // Both roles count the items with a row (`rows_done`: uses of the Q ring) and the K/V tiles so far
    // (`uses`: uses of the rings), and so agree on every buffer and barrier phase.
    if (warpgroup == 0) {
        release_registers<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            unsigned rows_done = 0, uses = 0;
            for (Walk walk(p); !walk.done();) {
                const Row row = walk.take(p);
                const Span span{row.begin, row.end - row.begin};
                if (span.count == 0) continue;
                Barrier& q_full = sh.q_ring.fill(rows_done, Q_BYTES);
                for (int r = 0; r < TILE_M; r += Q_ROWS)
                    tma_load_tile(sh.q[rows_done % Q_BUFFERS] + r * HEAD_DIM, q_map, q_full, row.q0 + r, row.h, row.b);
                ++rows_done;
                stream_kv<TILE_N, STAGES, V_STAGES>(p, span, row.h / p.group, row.b, sh.k, sh.v, k_map, v_map,
                                                    sh.k_ring, sh.v_ring, uses);
                uses += span.count;
            }
        }
        return;
    }
    claim_registers<CONSUMER_REGS>();

    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
    const int consumer = warpgroup - 1, rows = consumer * 64 + warp * 16;  // rows: the warp's first row in a tile
    float o[HEAD_DIM / 8][4];
    OnlineSoftmax sm;
    float sc[TILE_N / 8][4];
    unsigned pa[TILE_N / MMA_K][4];
    float alpha[2];
    // The consumer's 64 rows of Q's use `q_use`: its own copy, or its rows of the first panel of the tile's.
    auto q_rows = [&](unsigned q_use) {
        return sh.q[q_use % Q_BUFFERS] + consumer * 64 * (Q_ROWS == 64 ? HEAD_DIM : PANEL);
    };
    // Ring use `use` of K and V; Q's `q_use`.
    auto issue_scores_of = [&](unsigned q_use, unsigned use) {
        sh.k_ring.wait(use);
        issue_ABt<TILE_N, Q_ROWS>(sc, q_rows(q_use), sh.k[use % STAGES]);
    };
    auto issue_output_of = [&](unsigned use) {
        sh.v_ring.wait(use);
        issue_PB<TILE_N>(o, pa, sh.v[use % V_STAGES]);
    };
    // Once O += P V of `use` has landed: hands V's buffer back to the producer; pa is free again.
    auto finish_output_of = [&](unsigned use) {
        fence_operands(o, pa);
        sh.v_ring.release(use);
    };
    // Writes out row `r`, whose Q was use `q_use`, once its last O += P V has landed (STAGE_OUT: through its Q
    // buffer, which return_q then hands back).
    auto write_out = [&](const Row& r, unsigned q_use) {
        if (SPLIT_ROWS && r.part >= 0) {  // the combine pass writes the row
            store_part(p, sm, o, r.part, rows, lane);
            return;
        }
        if constexpr (STAGE_OUT) {
            float inv[2];
            finish_lse(p, sm, r.b, r.h, r.q0 + rows, lane, inv);
            OnlineSoftmax::rescale(o, inv);
            store_tile(o, 1.f, q_rows(q_use));
            fence_stores_for_async();
            named_barrier(OUT_BAR + consumer, 128);
            if (threadIdx.x % 128 == 0) {
                tma_store_tile(o_map, q_rows(q_use), r.q0 + consumer * 64, r.h, r.b);
                bulk_commit();
            }
        } else {
            finish_rows(p, sm, o, r.b, r.h, r.q0 + rows, lane);
        }
    };
    auto return_q = [&](unsigned q_use) {
        if (STAGE_OUT && threadIdx.x % 128 == 0) {
            bulk_wait_read();
            sh.q_ring.release(q_use);
        }
    };

    // Once a row has run (rows_done > 0), `last` is the one whose last O += P V, ring use uses - 1, is still to
    // be issued (its o, sm and pa are live): the next row's first turn issues it, or the turn after the loop.
    // The consumers take turns to issue (round the ring), consumer 0 first: the last consumer passes a turn
    // before its first and not after its last, so every wait meets exactly one arrival.
    Row last{};
    unsigned rows_done = 0, uses = 0;
    for (Walk walk(p); !walk.done();) {
        const Row row = walk.take(p);
        const int b = row.b, h = row.h, count = row.end - row.begin;
        if (count == 0) {
            OnlineSoftmax none;
            none.init();
            float zeros[HEAD_DIM / 8][4];
            zero(zeros);
            finish_rows(p, none, zeros, b, h, row.q0 + rows, lane);
            continue;
        }
        // The row's entries. The last step's read ahead takes the one past them, unused (the tables hold one past
        // the last row's).
        const int2* entries = p.entries + row.begin;
        // Mods, masks (with `masked`: entry e may be a partial tile) and exponentiates S_i once it has landed;
        // with `behind`, one product issued after S_i (groups complete in order) may still run. `ready`: the
        // tile's mask, worked out before (step 0).
        auto softmax_of = [&](int i, int2 e, bool behind, bool masked, const TileMask<TILE_N>* ready = nullptr) {
            if (!SPLIT_STEPS) e = entries[i];  // one copy: see step
            const int k0 = e.x * TILE_N;
            // The partial tile's loads and bits are worked out while the tensor cores run.
            const TileMask<TILE_N> mask =
                ready ? *ready : TileMask<TILE_N>(p, masked ? e.y : -1, b, h, row.q0, k0, rows, lane);
            wgmma_wait_behind(behind);
            fence_operands(sc);
            sh.k_ring.release(uses + i);
            if (!STAGE_OUT && i == count - 1) sh.q_ring.release(rows_done);  // the row's last use of Q
            apply_score_mod<false, TILE_N>(p, sc, b, h, TilePos<false>(p, row.q0, k0, rows, lane));
            mask.hide(p, sc, b, h, row.q0, k0, rows, lane);
            sm.step<SCALED_MAX, LAGGING_MAX>(sc, softmax_scale(p), alpha);
        };
        // Step i >= 1 over entry e. With SPLIT_STEPS (tuning.forward_split_steps), in two copies (each call
        // inlined with `masked` a constant): a full tile's has no mask, so no branch parts the wait for S from
        // the softmax, and ptxas waits for O += P V in the middle of the softmax rather than at the top of the
        // block after the mask's branch. The entry is then read a step ahead, so that the copy is chosen before
        // the step's products are issued; one copy reads it in softmax_of, once they are (reading it ahead is
        // slower there, at head dim 64).
        auto step = [&](int i, int2 e, bool masked) {
            take_turn(consumer);
            issue_scores_of(rows_done, uses + i);
            issue_output_of(uses + i - 1);  // reads P_{i-1} from pa while S_i goes to sc
            pass_turn(consumer);
            softmax_of(i, e, true, masked);
            wgmma_wait<0>();
            finish_output_of(uses + i - 1);
            // LAGGING_MAX (tuning.forward_lagging_max): where no row of the warp moved its max, alpha is 1.
            if (!LAGGING_MAX || __any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) OnlineSoftmax::rescale(o, alpha);
            to_a_fragments<TILE_N>(sc, pa);
        };
        auto entry = [&](int i) { return entries[i]; };
        // Step 0's entry and mask, and the next entry. With SPLIT_STEPS (head dim 128) they are loaded before the
        // last row goes out, whose stores would hold them back (each row's start would wait on these loads).
        // The narrow tiles at head dim 64 load them after, where loading them first is slower (docs/tuning.md:
        // the forward's first entry).
        const int2 first = SPLIT_STEPS ? entry(0) : int2{};
        int2 next = SPLIT_STEPS ? entry(1) : int2{};
        const TileMask<TILE_N> first_mask(p, SPLIT_STEPS ? first.y : -1, b, h, row.q0, first.x * TILE_N, rows, lane);

        // Step i issues S_i = Q K_i^T, then O += P_{i-1} V_{i-1}, and runs the softmax of S_i while the second
        // product is in flight; the output is rescaled once that product has landed. Step 0 issues the last
        // row's O += P V first instead and writes that row out while S_0 is in flight. Straight-line code
        // around the waits lets ptxas keep the products asynchronous.
        sh.q_ring.wait(rows_done);
        if (rows_done > 0) {
            take_turn(consumer);
            issue_output_of(uses - 1);
            issue_scores_of(rows_done, uses);
            pass_turn(consumer);
            wgmma_wait<1>();
            finish_output_of(uses - 1);
            write_out(last, rows_done - 1);
        } else {
            if (consumer == CONSUMERS - 1) pass_turn(consumer);
            take_turn(consumer);
            issue_scores_of(rows_done, uses);
            pass_turn(consumer);
        }
        zero(o);
        sm.init();
        // The output is zero: nothing to rescale.
        if (SPLIT_STEPS) {
            softmax_of(0, first, false, true, &first_mask);
        } else {
            next = entry(1);
            softmax_of(0, entry(0), false, true);
        }
        to_a_fragments<TILE_N>(sc, pa);
        // The last row's store has had this step's softmax to read its tile (the producer's next Q copy waits
        // for the buffer).
        if (rows_done > 0) return_q(rows_done - 1);
        for (int i = 1; i < count; ++i) {
            const int2 e = next;
            next = entry(i + 1);
            // One copy with a score mod: its code twice over would double the compile time.
            if (SCORE_MOD || !SPLIT_STEPS || e.y >= 0) {
                step(i, e, true);
            } else {
                step(i, e, false);
            }
        }
        last = row;
        ++rows_done;
        uses += count;
    }
    if (rows_done > 0) {
        take_turn(consumer);
        issue_output_of(uses - 1);
        if (consumer + 1 < CONSUMERS) pass_turn(consumer);
        wgmma_wait<0>();
        finish_output_of(uses - 1);
        write_out(last, rows_done - 1);
        if (STAGE_OUT && threadIdx.x % 128 == 0) bulk_wait_read();  // shared memory outlives the store's read
    }
}
