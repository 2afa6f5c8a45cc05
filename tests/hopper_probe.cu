// One warpgroup runs the Hopper primitives of kernels/hopper.cuh once, each result written out, so that a
// failure of a Hopper kernel can be pinned on one of them (tests/test_hopper_probe.py): the TMA copy (the
// raw, swizzled shared tile of K), S = Q K^T (wgmma from shared memory), O = P V (wgmma with P from
// registers, V read MN-major), O / 2 staged as a tile (stmatrix) and written by a TMA store, and the dQ
// product's pieces: X^T = K Q^T stored transposed (stmatrix) as a K-major tile X, then X K with K read
// MN-major; and, in csa_probe_add_share, the ordered sum of several CTAs' parts. The test prepends a
// backward_dkdv_sm90 prelude (its wgmma widths include 64) and hopper.cuh.
using namespace csa;

struct alignas(1024) ProbeShared {
    elem_t q[64 * HEAD_DIM];
    elem_t k[TILE_N * HEAD_DIM];
    elem_t v[TILE_N * HEAD_DIM];
    elem_t x[64 * 64];
    Barrier full;
};

// Writes a warpgroup's 64 x N accumulator row-major into out.
template <int N>
__device__ void store_accumulator(const float (&acc)[N / 8][4], float* out) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int n = 0; n < N / 8; ++n)
        for (int j = 0; j < 4; ++j) out[(warp * 16 + g + 8 * (j / 2)) * N + n * 8 + 2 * t + j % 2] = acc[n][j];
}

extern "C" __global__ void __launch_bounds__(128)
    csa_probe(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
              const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap o_map, elem_t* k_raw,
              float* s_out, float* o_out, elem_t* x_raw, float* xk_out) {
    extern __shared__ unsigned char smem_raw[];
    ProbeShared& sh = aligned_shared<ProbeShared>(smem_raw);
    if (threadIdx.x == 0) {
        sh.full.init(1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sh.full.expect_bytes((64 + 2 * TILE_N) * HEAD_DIM * sizeof(elem_t));
        tma_load_tile(sh.q, q_map, sh.full, 0, 0, 0);
        tma_load_tile(sh.k, k_map, sh.full, 0, 0, 0);
        tma_load_tile(sh.v, v_map, sh.full, 0, 0, 0);
    }
    sh.full.wait(0);
    for (int i = threadIdx.x; i < TILE_N * HEAD_DIM; i += 128) k_raw[i] = sh.k[i];

    float s[TILE_N / 8][4];
    issue_ABt<TILE_N, 64>(s, sh.q, sh.k);
    wgmma_wait<0>();
    fence_operands(s);
    store_accumulator<TILE_N>(s, s_out);

    unsigned pa[TILE_N / 16][4];
    to_a_fragments<TILE_N>(s, pa);
    float o[HEAD_DIM / 8][4];
    zero(o);
    issue_PB<TILE_N>(o, pa, sh.v);
    wgmma_wait<0>();
    fence_operands(o);
    fence_operands(pa);
    store_accumulator<HEAD_DIM>(o, o_out);
    store_tile(o, 0.5f, sh.v);  // V is read: its first 64 rows' worth take O's tile
    fence_stores_for_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        tma_store_tile(o_map, sh.v, 0, 0, 0);
        bulk_commit();
        bulk_wait_read();
    }

    float xt[64 / 8][4];  // K's first 64 rows against Q's 64: the transpose of S's first 64 columns
    issue_ABt<64, TILE_N>(xt, sh.k, sh.q);
    wgmma_wait<0>();
    fence_operands(xt);
    unsigned xf[64 / 16][4];
    to_a_fragments<64>(xt, xf);
    store_transposed<64>(xf, sh.x);
    fence_stores_for_async();
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * 64; i += 128) x_raw[i] = sh.x[i];
    float xk[HEAD_DIM / 8][4];
    issue_AB<HEAD_DIM, 64, 64, TILE_N>(xk, sh.x, sh.k);
    wgmma_wait<0>();
    fence_operands(xk);
    store_accumulator<HEAD_DIM>(xk, xk_out);
}

// CTA c adds parts[c] (64 x 64 floats) into tile at rank ranks[c], through shared memory as the fused
// backward's dQ adds go, in rank order or (ordered = 0, tile zeroed) as they come. counter starts at 0.
extern "C" __global__ void __launch_bounds__(128)
    csa_probe_add_share(const float* parts, const int* ranks, float* tile, int* counter, int ordered) {
    __shared__ __align__(128) float part[64 * 64];
    for (int i = threadIdx.x; i < 64 * 64; i += 128) part[i] = parts[blockIdx.x * 64 * 64 + i];
    fence_stores_for_async();
    __syncthreads();
    if (threadIdx.x == 0) add_share(tile, part, sizeof(part), counter, ranks[blockIdx.x], ordered);
}
