// The forward's last pass where its deal split rows (schedule.work_order): each split row's out and lse from its
// parts', which forward_sm90.cu left in their slots of the scratch (store_part: lse, then out = acc / l):
// lse = log sum_i exp(lse_i), out = sum_i exp(lse_i - lse) out_i. Grid: (split rows, TILE_M / NWARPS), a warp
// for each query row; a lane holds the weights of parts lane and lane + 32 (schedule.SPLIT_COUNTS: 64 parts a row
// at most) and makes two columns at a time.
#include "common.cuh"

using namespace csa;

static_assert(HEAD_DIM == HEAD_DIM_REAL, "the Hopper forward takes whole 64-element panels");

extern "C" __global__ void __launch_bounds__(NWARPS * 32) csa_forward_combine(const __grid_constant__ Params p) {
    const int first = p.split_ptr[blockIdx.x], parts = p.split_ptr[blockIdx.x + 1] - first;
    const int* row0 = p.parts + 5 * first;  // every part of the row has its b, h and first query
    const int b = row0[0], h = row0[1], r = blockIdx.y * NWARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q = row0[2] + r;
    if (r >= TILE_M || q >= p.seq_q) return;
    const float* slots = p.stats + (long long)first * PART_SLOT;
    const float lse0 = lane < parts ? slots[lane * PART_SLOT + r] : -INFINITY;
    const float lse1 = lane + 32 < parts ? slots[(lane + 32) * PART_SLOT + r] : -INFINITY;
    const float most = lanes_max<32>(fmaxf(lse0, lse1));
    float lse = -INFINITY, w0 = 0.f, w1 = 0.f;
    if (most > -INFINITY) {  // a row with a visible key in some part
        lse = most + logf(lanes_sum<32>(expf(lse0 - most) + expf(lse1 - most)));
        w0 = expf(lse0 - lse);
        w1 = expf(lse1 - lse);
    }
    elem_t* out = p.o + b * p.o_sb + h * p.o_sh + q * p.o_ss;
#pragma unroll
    for (int col = 2 * lane; col < HEAD_DIM; col += 64) {
        float2 acc = make_float2(0.f, 0.f);
#pragma unroll 4
        for (int i = 0; i < parts; ++i) {
            const float weight = __shfl_sync(0xffffffffu, i < 32 ? w0 : w1, i % 32);
            const float2 x = *reinterpret_cast<const float2*>(slots + i * PART_SLOT + TILE_M + r * HEAD_DIM + col);
            acc.x += weight * x.x;
            acc.y += weight * x.y;
        }
        *reinterpret_cast<elem2_t*>(out + col) = pack2(acc.x, acc.y);
    }
    if (lane == 0) p.lse[b * p.lse_sb + h * p.lse_sh + q] = lse;
}
