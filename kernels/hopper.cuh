// Hopper (sm_90a) tile primitives: barriers in shared memory, TMA tile copies, shared-memory matrix
// descriptors and warpgroup MMAs. The names follow the algorithm; the PTX is in one place, here.
//
// Shared tiles are [HEAD_DIM / PANEL panels][rows][PANEL elements]: 128-byte rows (64 fp16 / bf16 elements, 32
// float32 ones), 16-byte chunks swizzled with the row (chunk ^= row % 8) by the TMA copy, each panel starting
// at a 1024-byte boundary. That is the "128-byte swizzle" canonical layout wgmma reads without bank conflicts,
// K-major (Q, K: the reduction runs along the row) or MN-major (V: the reduction runs across rows).
//
// float32 multiplies in TF32, whose wgmma reads both shared operands K-major only: a product P B that reduces
// over B's rows (P V, dS K, P^T dO, dS^T Q) then reads B's transposed copy (transpose.cu), [head dims][rows],
// as a K-major B (B_TRANSPOSED).
//
// The builder adds to the prelude, for each N a kernel multiplies with (an asm operand list is fixed text):
//   wgmma_ss<N>(float (&d)[N / 8][4], desc a, desc b, int accumulate)   D (+)= A B, both from shared memory
//   wgmma_rs<N>(float (&d)[N / 8][4], const unsigned (&a)[4], desc b)    D += A B, A from registers, B MN-major
//                                                                        (K-major for TF32)
// Both are m64nNk16 (m64nNk8 for TF32: one step is 32 bytes of a row either way) with fp32 accumulators: a
// warpgroup's 64 rows, a warp's 16 of them laid out as an mma.sync accumulator, so the helpers of common.cuh
// (mask, score mod, softmax, stores) apply unchanged.
#pragma once

#include "common.cuh"

namespace csa {

// Every Hopper pass: one producer warpgroup and consumer warpgroups of 64 rows (queries, or keys in the dK/dV
// pass): two, or three in the forward's wide tiles at head dim 64 (the builder's NWARPS); rings of
// STAGES buffers (the builder's HOPPER_STAGES), tiles of whole 64-element panels.
constexpr int THREADS = NWARPS * 32;
constexpr int CONSUMERS = NWARPS / 4 - 1;
static_assert(NWARPS % 4 == 0 && CONSUMERS >= 2, "one producer and two or more consumer warpgroups");
static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM == HEAD_DIM_REAL, "tiles are whole 64-element panels");
// Elements of a 128-byte swizzled row.
constexpr int PANEL = 128 / sizeof(elem_t);
// TF32's products P B read B transposed (transpose.cu).
constexpr bool B_TRANSPOSED = CSA_DTYPE_F32;

// A CUtensorMap (the driver's 128-byte opaque TMA descriptor), passed as a __grid_constant__ kernel argument.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned smem_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- barriers ---------------------------------------------------------------------------------------------
// An mbarrier: a phase completes when `count` threads have arrived and the bytes announced with
// expect_bytes have landed. Waiters name the parity of the phase they wait for.
struct Barrier {
    unsigned long long word;

    __device__ __forceinline__ void init(unsigned count) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(this)), "r"(count));
    }
    // Arrives and announces `bytes` more that copies will bring in this phase.
    __device__ __forceinline__ void expect_bytes(unsigned bytes) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(this)),
                     "r"(bytes)
                     : "memory");
    }
    __device__ __forceinline__ void arrive() {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(this)) : "memory");
    }
    // Returns once the phase of this parity has completed. Parity 1 before the first completion returns at
    // once: a producer's first pass over empty buffers does not wait. With BARRIER_SLEEPS, a thread whose try
    // fails sleeps until the barrier moves (the suspend-time hint: NANOSLEEP.SYNCS) rather than trying again
    // at once: the forward's producer thread spun 211 tries a key tile while it waited for a free buffer.
    __device__ __forceinline__ void wait(unsigned parity) {
        unsigned done;
        do {
            if constexpr (BARRIER_SLEEPS) {
                asm volatile(
                    "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
                    "selp.u32 %0, 1, 0, p;\n}\n"
                    : "=r"(done)
                    : "r"(smem_address(this)), "r"(parity), "n"(10000000)
                    : "memory");
            } else {
                asm volatile(
                    "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                    "selp.u32 %0, 1, 0, p;\n}\n"
                    : "=r"(done)
                    : "r"(smem_address(this)), "r"(parity)
                    : "memory");
            }
        } while (!done);
    }
};

// A ring of DEPTH shared buffers that one producer thread fills by TMA and the consumer warpgroups drain, use
// i going to buffer i % DEPTH. Each buffer has a barrier that completes when its copies have landed (full)
// and one that completes when every consumer thread has released it (empty). Uses are unsigned: % and / by
// DEPTH then take no sign fix-ups, a few uniform instructions at every wait of a step.
template <int DEPTH>
struct Ring {
    Barrier full[DEPTH], empty[DEPTH];

    __device__ __forceinline__ void init(unsigned consumer_threads) {
        for (int s = 0; s < DEPTH; ++s) {
            full[s].init(1);
            empty[s].init(consumer_threads);
        }
    }
    // The producer: waits until use i - DEPTH has been released, announces use i's bytes and returns the
    // barrier its copies complete on. The first DEPTH uses do not wait (parity 1 of a fresh barrier).
    __device__ __forceinline__ Barrier& fill(unsigned i, unsigned bytes) {
        empty[i % DEPTH].wait(((i / DEPTH) & 1) ^ 1);
        full[i % DEPTH].expect_bytes(bytes);
        return full[i % DEPTH];
    }
    __device__ __forceinline__ void wait(unsigned i) { full[i % DEPTH].wait((i / DEPTH) & 1); }
    __device__ __forceinline__ void release(unsigned i) { empty[i % DEPTH].arrive(); }
};

// The kernel's shared struct at the first 1024-byte boundary of dynamic shared memory, which is only
// guaranteed 16-byte alignment; swizzled tiles need the boundary, and the launch adds 1024 bytes for it.
// Offsetting the shared array itself (not an integer address) keeps its accesses LDS/STS, not generic.
template <class T>
__device__ __forceinline__ T& aligned_shared(unsigned char* raw) {
    return *reinterpret_cast<T*>(raw + ((1024 - (smem_address(raw) & 1023)) & 1023));
}
// The shared struct at the start of dynamic shared memory, for a kernel whose struct leaves no room for
// those 1024 bytes (the fused backward's fills the 227 KiB). On sm_90 the start has been on a 1024-byte
// boundary in every launch so far (the GPU tests, the sanitizer, the benchmarks); a start off it traps.
template <class T>
__device__ __forceinline__ T& shared_at_start(unsigned char* raw) {
    if (smem_address(raw) & 1023) __trap();
    return *reinterpret_cast<T*>(raw);
}

// Makes initialised barriers visible to the TMA unit (the async proxy) before the first copy uses them.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------------------------------------------
// Copies rows [row0, row0 + ROWS) of head `head`, batch `batch` of a [B, H, S, D] tensor into a shared tile
// (the map's box of panels from `panel0`: the map's dims are (PANEL, S, D / PANEL, H, B), its box all D / PANEL
// panels, or a tile's of a transposed copy: tma_load_rows); rows past the sequence are zero-filled. Completes
// on `bar`, which must expect the box's bytes.
__device__ __forceinline__ void tma_load_tile(elem_t* dst, const TensorMap& map, Barrier& bar, int row0, int head,
                                              int batch, int panel0 = 0) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(smem_address(dst)),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(0), "r"(row0), "r"(panel0), "r"(head), "r"(batch),
        "r"(smem_address(&bar))
        : "memory");
}

// Copies rows [row0, row0 + ROWS) of a [B, H, S, D] tensor as tma_load_tile does, or (TRANSPOSED) the same
// rows of its transposed copy (transpose.cu: [B, H, D, S padded]): the panels from row0 / PANEL of its HEAD_DIM
// rows, through a map whose box is ROWS / PANEL of them.
template <bool TRANSPOSED>
__device__ __forceinline__ void tma_load_rows(elem_t* dst, const TensorMap& map, Barrier& bar, int row0, int head,
                                              int batch) {
    if constexpr (TRANSPOSED) {
        tma_load_tile(dst, map, bar, 0, head, batch, row0 / PANEL);
    } else {
        tma_load_tile(dst, map, bar, row0, head, batch);
    }
}

// Copies `bytes` (a multiple of 16, from a 16-byte aligned address) into shared memory; completes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, Barrier& bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_address(dst)),
                 "l"(src), "r"(bytes), "r"(smem_address(&bar))
                 : "memory");
}

// Copies a 64-row shared tile (store_tile's) to rows [row0, row0 + 64) of head `head`, batch `batch` of a
// [B, H, S, D] tensor, through a map of 64-row tiles; rows past the sequence are not written. The issuing
// thread commits it (bulk_commit) and waits for its read (bulk_wait_read) before the tile is written again.
__device__ __forceinline__ void tma_store_tile(const TensorMap& map, const elem_t* src, int row0, int head,
                                               int batch) {
    asm volatile(
        "cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n" ::"l"(
            reinterpret_cast<unsigned long long>(&map)),
        "r"(0), "r"(row0), "r"(0), "r"(head), "r"(batch), "r"(smem_address(src))
        : "memory");
}

// Closes the bulk copies this thread issued since its last commit into a group.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's committed bulk copies have read their shared sources (not until their writes land).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// The forward producer's part of a row: the K and V tiles (ROWS keys, key/value head hk, batch element b) of
// each entry of `span` into their rings (of K_DEPTH and V_DEPTH buffers), the next copy issued as soon as a
// buffer is free; V's tiles from its transposed copy where B_TRANSPOSED (tma_load_rows). The rings have been
// used `first` times before (earlier work items of a persistent CTA). Step i multiplies by K_i and then
// V_{i-1}: each K tile is copied before the V tile of the entry before it, in the order the consumers wait
// for them.
template <int ROWS, int K_DEPTH, int V_DEPTH>
__device__ __forceinline__ void stream_kv(const Params& p, Span span, int hk, int b, elem_t (*k)[ROWS * HEAD_DIM],
                                          elem_t (*v)[ROWS * HEAD_DIM], const TensorMap& k_map,
                                          const TensorMap& v_map, Ring<K_DEPTH>& k_ring, Ring<V_DEPTH>& v_ring,
                                          unsigned first) {
    constexpr unsigned BYTES = ROWS * HEAD_DIM * sizeof(elem_t);
    auto load_v = [&](int i) {
        const unsigned use = first + i;
        const int k0 = p.entries[span.begin + i].x * ROWS;
        tma_load_rows<B_TRANSPOSED>(v[use % V_DEPTH], v_map, v_ring.fill(use, BYTES), k0, hk, b);
    };
    for (int i = 0; i < span.count; ++i) {
        const int k0 = p.entries[span.begin + i].x * ROWS;
        const unsigned use = first + i;
        tma_load_tile(k[use % K_DEPTH], k_map, k_ring.fill(use, BYTES), k0, hk, b);
        if (i > 0) load_v(i - 1);
    }
    if (span.count > 0) load_v(span.count - 1);
}

// ---- warpgroup MMA ----------------------------------------------------------------------------------------
// The descriptor of a swizzled shared matrix at `p`. K-major: 8-row groups 1024 bytes apart (the leading
// offset is unused). MN-major: the same along the reduction, and `panel_bytes` between the 64-wide panels of
// the N dimension.
__device__ __forceinline__ unsigned long long smem_desc(const void* p, unsigned panel_bytes = 16) {
    return static_cast<unsigned long long>((smem_address(p) & 0x3FFFF) >> 4) |
           static_cast<unsigned long long>(panel_bytes >> 4) << 16 | static_cast<unsigned long long>(1024 >> 4) << 32 |
           1ull << 62;  // 128-byte swizzle
}

// The descriptor of the element `elements` on from the one `desc` describes (in the same tile). Only the start
// address, in the low word, moves (inside shared memory it never carries out of its field): a product's steps
// take one add each to a descriptor worked out once.
__device__ __forceinline__ unsigned long long desc_plus(unsigned long long desc, int elements) {
    const unsigned step = elements * static_cast<unsigned>(sizeof(elem_t)) / 16;
#if DESC_ADD64
    return desc + step;  // tuning.descriptor_add64: one 64-bit add, issued as one uniform add (UIADD3.64)
#else
    return desc >> 32 << 32 | (static_cast<unsigned>(desc) + step);
#endif
}

// Orders this thread's register accesses before the warpgroup MMAs that follow (accumulators rescaled, A
// fragments written).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Waits for the issued groups, but for the last BEHIND ones when `behind` (groups complete in order).
template <int BEHIND = 1>
__device__ __forceinline__ void wgmma_wait_behind(bool behind) {
    if (behind) {
        wgmma_wait<BEHIND>();
    } else {
        wgmma_wait<0>();
    }
}

// Keeps the compiler from touching an MMA's registers while it is in flight: after the wait, they count as
// read and written here (accumulators), or as live until here (A fragments). Takes several at once.
template <int N>
__device__ __forceinline__ void fence_operands(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(unsigned (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}
template <class A, class B, class... Rest>
__device__ __forceinline__ void fence_operands(A& a, B& b, Rest&... rest) {
    fence_operands(a);
    fence_operands(b, rest...);
}

// ---- tile products ----------------------------------------------------------------------------------------
// acc (64 x N) = A B^T over HEAD_DIM: A the 64 rows at `a` of a shared tile whose panels hold A_ROWS rows, B an
// N-row shared tile; both K-major. Issued as one group and left in flight (wgmma_wait, then fence_operands).
template <int N, int A_ROWS>
__device__ __forceinline__ void issue_ABt(float (&acc)[N / 8][4], const elem_t* a, const elem_t* b) {
    const unsigned long long da = smem_desc(a), db = smem_desc(b);
    wgmma_fence();
#pragma unroll
    for (int kd = 0; kd < HEAD_DIM / MMA_K; ++kd) {
        // Panel kd / 4; inside it, MMA_K elements (32 bytes) per step along the swizzled row.
        const int panel = kd / 4, col = (kd % 4) * MMA_K;
        wgmma_ss<N>(acc, desc_plus(da, panel * A_ROWS * PANEL + col), desc_plus(db, panel * N * PANEL + col),
                    kd > 0);
    }
    wgmma_commit();
}

// acc (64 x HEAD_DIM) += P B: P (64 x K) as A fragments in registers, B a K-row shared tile read MN-major, or
// (B_TRANSPOSED) a HEAD_DIM-row tile of K columns read K-major. Issued as one group and left in flight; P must
// stay untouched until it lands.
template <int K>
__device__ __forceinline__ void issue_PB(float (&acc)[HEAD_DIM / 8][4], const unsigned (&pa)[K / MMA_K][4],
                                         const elem_t* b) {
    const unsigned long long db = B_TRANSPOSED ? smem_desc(b) : smem_desc(b, K * 128);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / MMA_K; ++kk) {
        const int step = B_TRANSPOSED ? (kk / 4) * HEAD_DIM * PANEL + (kk % 4) * MMA_K : kk * MMA_K * PANEL;
        wgmma_rs<HEAD_DIM>(acc, pa[kk], desc_plus(db, step));
    }
    wgmma_commit();
}

#if CSA_DTYPE_F32
// Columns [8 kk, 8 kk + 8) of an fp32 accumulator (64 x K), each element times `factor` and rounded to TF32, as
// the A fragment of one 8-deep step. The fragment holds a quad's columns t and t + 4 where the accumulator
// holds 2t and 2t + 1; B's transposed copy orders each 8 rows so (transpose.cu), so that the accumulator's
// registers are the fragment as they lie.
template <int K>
__device__ __forceinline__ void a_fragment(const float (&acc)[K / 8][4], int kk, float factor, unsigned (&frag)[4]) {
    frag[0] = to_tf32(acc[kk][0] * factor);
    frag[1] = to_tf32(acc[kk][2] * factor);
    frag[2] = to_tf32(acc[kk][1] * factor);
    frag[3] = to_tf32(acc[kk][3] * factor);
}
#else
// Columns [16 kk, 16 kk + 16) of an fp32 accumulator (64 x K), each element times `factor`, as the A fragment
// of one 16-deep step: the C layout of two adjacent 8-column tiles is the A layout of that step.
template <int K>
__device__ __forceinline__ void a_fragment(const float (&acc)[K / 8][4], int kk, float factor, unsigned (&frag)[4]) {
    frag[0] = pack_u32(acc[2 * kk][0] * factor, acc[2 * kk][1] * factor);
    frag[1] = pack_u32(acc[2 * kk][2] * factor, acc[2 * kk][3] * factor);
    frag[2] = pack_u32(acc[2 * kk + 1][0] * factor, acc[2 * kk + 1][1] * factor);
    frag[3] = pack_u32(acc[2 * kk + 1][2] * factor, acc[2 * kk + 1][3] * factor);
}
#endif

// An fp32 accumulator (64 x K) as the A fragments of a product with it.
template <int K>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[K / 8][4], unsigned (&pa)[K / MMA_K][4]) {
#pragma unroll
    for (int kk = 0; kk < K / MMA_K; ++kk) a_fragment<K>(acc, kk, 1.f, pa[kk]);
}

// stmatrix: a warp's four 8 x 8 blocks of 16-bit elements (frag[j] of each lane: block j in the mma.sync
// accumulator layout) to shared memory, lane l giving the address of row l % 8 of block l / 8. TRANS writes
// each block's columns as its rows.
template <bool TRANS>
__device__ __forceinline__ void store_matrices(unsigned address, const unsigned (&frag)[4]) {
    if constexpr (TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
                     "r"(frag[0]), "r"(frag[1]), "r"(frag[2]), "r"(frag[3])
                     : "memory");
    else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
                     "r"(frag[0]), "r"(frag[1]), "r"(frag[2]), "r"(frag[3])
                     : "memory");
}

// Stores a warpgroup's 64 x N product, as its A fragments (rows: the warpgroup's 64, 16 a warp), transposed
// into `panel`: a swizzled shared panel of N rows and 64 columns, column c of row n holding element [c][n]. That
// is the K-major A tile of a product that reduces over the warpgroup's rows (dQ = dS K from dS^T). .trans
// writes each 8 x 8 block's columns as 16-byte rows, which are the swizzle's chunks.
template <int N>
__device__ __forceinline__ void store_transposed(const unsigned (&frag)[N / 16][4], elem_t* panel) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
    const int block = lane / 8, i = lane % 8;  // this lane addresses row i of 8 x 8 block `block` (frag[.][block])
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        const int row = 16 * kk + 8 * (block >> 1) + i;  // a column of the fragments
        const int chunk = 2 * warp + (block & 1);        // 8 of the warpgroup's rows
        store_matrices<true>(smem_address(panel) + row * 128 + ((chunk ^ (row % 8)) * 16), frag[kk]);
    }
}

// Stores a warpgroup's 64 x HEAD_DIM accumulator, each element times `factor`, into `tile`: a 64-row shared
// tile laid out as a TMA copy lands one ([HEAD_DIM / 64 panels][64 rows][64], swizzled), which tma_store_tile
// then writes out. Each 8 x 8 block's rows are the swizzle's 16-byte chunks. 16-bit elements (stmatrix).
__device__ __forceinline__ void store_tile(const float (&acc)[HEAD_DIM / 8][4], float factor, elem_t* tile) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31, block = lane / 8;
    const int row = warp * 16 + 8 * (block & 1) + lane % 8;  // this lane's row of block `block`
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const int chunk = 2 * kk + (block >> 1);  // of 8 columns, along the row
        unsigned frag[4];
        a_fragment<HEAD_DIM>(acc, kk, factor, frag);
        store_matrices<false>(
            smem_address(tile) + (chunk / 8) * 64 * 128 + row * 128 + ((chunk % 8) ^ (row % 8)) * 16, frag);
    }
}

// Makes this thread's shared-memory stores visible to the async proxy that reads them after a barrier: the
// warpgroup MMAs, TMA stores and bulk copies.
__device__ __forceinline__ void fence_stores_for_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// acc (64 x N) = A B over K: A the 64 rows at `a` of a K-major shared tile whose panels of 64 columns hold
// A_ROWS rows (store_transposed's), B the first K rows of a shared tile of B_ROWS rows from `b`, read MN-major
// (N columns: one 64-wide panel, or HEAD_DIM of them). Issued as one group and left in flight.
template <int N, int K, int A_ROWS, int B_ROWS>
__device__ __forceinline__ void issue_AB(float (&acc)[N / 8][4], const elem_t* a, const elem_t* b) {
    const unsigned long long da = smem_desc(a), db = smem_desc(b, B_ROWS * 128);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const int panel = kk / 4, col = (kk % 4) * 16;
        wgmma_ss_bmn<N>(acc, desc_plus(da, panel * A_ROWS * 64 + col), desc_plus(db, kk * 16 * 64), kk > 0);
    }
    wgmma_commit();
}

// The calling thread's warpgroup, through a shuffle so that ptxas knows it is the same across a warp: what
// derives from it (the descriptors of the warpgroup's rows of Q, K or V) then stays in uniform registers, not
// copied there (R2UR) before each wgmma (the forward: 8 to 16 fewer instructions a step). The dK/dV pass keeps
// threadIdx.x / 128: it spills at head dim 128 with this.
__device__ __forceinline__ int uniform_warpgroup() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

// Waits at named barrier `id` (0 is __syncthreads') until `threads` threads have arrived at it.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Turns among the consumer warpgroups, round the ring (named barriers 1 to CONSUMERS, 256 threads each: one
// warpgroup waits, the one before it arrives). Consumer c takes its turn on barrier 1 + c and passes it to the
// next on barrier 1 + (c + 1) % CONSUMERS: while one issues its products, the others run their softmax.
__device__ __forceinline__ void take_turn(int consumer) { named_barrier(1 + consumer, 256); }
__device__ __forceinline__ void pass_turn(int consumer) {
    // The next consumer's barrier, 1 + (consumer + 1) % CONSUMERS, as a select that is cheap enough to redo
    // where it is needed rather than keep in a register.
    asm volatile("bar.arrive %0, 256;\n" ::"r"(consumer + 1 == CONSUMERS ? 1 : consumer + 2) : "memory");
}

// ---- sums in a fixed order across CTAs ----------------------------------------------------------------------
// Several CTAs add their parts into one fp32 tile in global memory, each at its rank, so that the sum comes out
// the same bits every run without atomics on the data: a counter beside the tile holds how many adds are done.
__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int load_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// The add ranked `rank` of `part` (shared, `bytes`) into `tile` (global fp32, as long), by one thread: waits
// until `counter` reads `rank`, then copies (rank 0) or adds the part in by a bulk TMA reduction, waits for it
// to land, and sets the counter to rank + 1. Only one CTA writes the tile at a time, in rank order, so every
// element sums in that order: the same bits every run. `part`'s generic stores must be fenced for the async
// proxy (fence_stores_for_async) by the threads that made them.
// Not `ordered` (the tile zeroed before: CUSPARSEATTN_DETERMINISTIC=0), every part is added as soon as it
// comes, as FlashAttention's atomic dQ adds are, and waited for only until it has been read; the L2 adds
// each element atomically, in the order the parts land, and rank 0 sets the counter to 1 (the tile was
// visited).
__device__ __forceinline__ void add_share(float* tile, const float* part, unsigned bytes, int* counter, int rank,
                                          bool ordered) {
    if (ordered) {
        // Polled relaxed, then acquired once: an acquiring load invalidates the SM's L1 (CCTL.IVALL) each time.
        while (load_relaxed(counter) != rank) __nanosleep(32);
        load_acquire(counter);
        asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the earlier adds, seen by this one
    }
    if (ordered && rank == 0) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(tile),
                     "r"(smem_address(part)), "r"(bytes)
                     : "memory");
    } else {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(tile),
                     "r"(smem_address(part)), "r"(bytes)
                     : "memory");
    }
    bulk_commit();
    if (ordered) {
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        asm volatile("fence.proxy.async.global;\n" ::: "memory");  // this add, before the counter says so
        store_release(counter, rank + 1);
    } else {
        bulk_wait_read();
        if (rank == 0) *counter = 1;
    }
}

// ---- a key tile's column ------------------------------------------------------------------------------------
// The uses of a key tile by the backward, in order: the entries of its layout column for each query head of
// the group in turn. SCHEDULED (the fused backward, schedule.column_schedule): each column's entries from its
// col_start on, wrapping around, and each visit's rank among the adds into its query tile.
template <bool SCHEDULED>
struct ColumnWalk {
    const Params& p;
    int b = -1, hk = 0, tile_k = 0;  // b < 0: no key tile
    int j = -1, i = 0;               // head of the group, step of its column
    int start = 0, column = 0;  // SCHEDULED: the column's first entry, its index among the call's columns
    Span span{0, 0};

    __device__ ColumnWalk(const Params& p_, int b_, int hk_, int tile_k_) : p(p_), b(b_), hk(hk_), tile_k(tile_k_) {
        skip_empty();
    }
    // SCHEDULED: the schedule's item (b * heads_kv + hk) * tiles_k + tile_k; none (b < 0) for item < 0.
    __device__ ColumnWalk(const Params& p_, int item) : p(p_) {
        if (item < 0) return;
        const int heads_kv = p.heads_q / p.group;
        tile_k = item % p.tiles_k;
        hk = (item / p.tiles_k) % heads_kv;
        b = item / (p.tiles_k * heads_kv);
        skip_empty();
    }
    __device__ bool done() const { return j >= p.group; }
    __device__ int h() const { return hk * p.group + j; }
    __device__ int2 entry() const {
        if constexpr (SCHEDULED)
            return p.col_entries[span.begin + (start + i) % span.count];
        else
            return p.col_entries[span.begin + i];
    }
    __device__ int rank() const {
        static_assert(SCHEDULED, "ranks come with the fused backward's schedule");
        return p.ranks[p.rank_ptr[column] + i];
    }
    __device__ void next() {
        ++i;
        skip_empty();
    }

  private:
    __device__ void skip_empty() {
        while (i >= span.count && ++j < p.group) {
            span = column_span(p, b, h(), tile_k);
            if constexpr (SCHEDULED) {
                column = (b * p.heads_q + h()) * p.tiles_k + tile_k;
                start = p.col_start[column];
            }
            i = 0;
        }
    }
};

// ---- registers ------------------------------------------------------------------------------------------
// A warpgroup's per-thread register budget: the producer gives registers back, the consumers take them.
template <int REGS>
__device__ __forceinline__ void release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace csa
