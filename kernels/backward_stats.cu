// The fused backward's first pass (backward_sm90.cu reads what it writes): each query row's statistics,
// lse * log2(e) and delta = rowsum(dO * O), as the dQ passes work them out for the dK/dV passes (common.cuh's
// row_stats), over the whole padded length; and each query tile's dQ counter zeroed (and its sum, for adds in
// any order). One CTA per TILE_M rows of a (query head, batch element), a warp per 16 rows.
#include "common.cuh"

using namespace csa;

static_assert(TILE_M == NWARPS * 16, "each warp takes 16 rows");

extern "C" __global__ void __launch_bounds__(NWARPS * 32) csa_backward_stats(const __grid_constant__ Params p) {
    const int h = blockIdx.y, b = blockIdx.z;
    float lse2[2], delta[2];
    row_stats(p, b, h, blockIdx.x * TILE_M + threadIdx.x / 32 * 16, threadIdx.x & 31, lse2, delta);
    if (threadIdx.x == 0) dq_counters(p, b, h)[blockIdx.x] = 0;
    if (p.dq_unordered) {  // every part is added in: the sums start at zero
        float4* sum = reinterpret_cast<float4*>(dq_sum(p, b, h, blockIdx.x));
        for (int i = threadIdx.x; i < TILE_M * HEAD_DIM / 4; i += NWARPS * 32)
            sum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}
