// The fused backward's first pass (backward_sm90.cu reads what it writes): each query row's statistics,
// lse * log2(e) and delta = rowsum(dO * O), as the dQ passes work them out for the dK/dV passes (common.cuh's
// row_stats), over the whole padded length; and each query tile's dQ counter zeroed. One CTA per TILE_M rows
// of a (query head, batch element), a warp per 16 rows.
#include "common.cuh"

using namespace csa;

static_assert(TILE_M == NWARPS * 16, "each warp takes 16 rows");

extern "C" __global__ void __launch_bounds__(NWARPS * 32) csa_backward_stats(const __grid_constant__ Params p) {
    const int h = blockIdx.y, b = blockIdx.z;
    float lse2[2], delta[2];
    row_stats(p, b, h, blockIdx.x * TILE_M + threadIdx.x / 32 * 16, threadIdx.x & 31, lse2, delta);
    if (threadIdx.x == 0) dq_counters(p, b, h)[blockIdx.x] = 0;
}
