// The fused backward's last pass: dQ = scale * the fp32 sums that backward_sm90.cu left in the scratch,
// rounded to the element type; zeros for a query tile that no key tile visited (its counter still 0). One CTA
// per (query tile, query head, batch element); a thread converts 8 elements (16 bytes of dQ) at a time.
#include "common.cuh"

using namespace csa;

static_assert(HEAD_DIM == HEAD_DIM_REAL, "the fused backward takes whole 64-element panels");

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
    csa_backward_dq_convert(const __grid_constant__ Params p) {
    const int tile_q = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const bool visited = dq_counters(p, b, h)[tile_q] > 0;
    const float* sum = dq_sum(p, b, h, tile_q);
    elem_t* dq = p.dq + b * p.dq_sb + h * p.dq_sh;
    constexpr int CHUNKS = HEAD_DIM / 8;
    const int rows = min(TILE_M, p.seq_q - tile_q * TILE_M);
    for (int i = threadIdx.x; i < rows * CHUNKS; i += NWARPS * 32) {
        const int row = i / CHUNKS, col = i % CHUNKS * 8;
        float x[8] = {};
        if (visited) {
            const float* chunk = sum + (col / 8 * TILE_M + row) * 8;  // as dq_sum lays it out
            const float4 lo = *reinterpret_cast<const float4*>(chunk);
            const float4 hi = *reinterpret_cast<const float4*>(chunk + 4);
            x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
        }
        uint4 out;
        elem2_t* out2 = reinterpret_cast<elem2_t*>(&out);
#pragma unroll
        for (int j = 0; j < 4; ++j) out2[j] = pack2(x[2 * j] * p.scale, x[2 * j + 1] * p.scale);
        *reinterpret_cast<uint4*>(dq + (tile_q * TILE_M + row) * p.dq_ss + col) = out;
    }
}
