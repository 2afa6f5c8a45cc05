// float32's Hopper forward reads V transposed: TF32's wgmma takes both shared operands K-major, and in P V the
// reduction runs over V's rows (hopper.cuh: V_TRANSPOSED). This pass, launched before it, copies V [B, Hkv,
// Sk, D] to vt [B, Hkv, D, Sk padded to 32] (the TMA copies that read it round to TF32: tma.py), the keys of
// each 8 in the order 0, 2, 4, 6, 1, 3, 5, 7: a TF32 A fragment holds a quad's columns t and t + 4 where P's
// accumulator holds 2t and 2t + 1 (hopper.cuh's a_fragment), so that P's registers are the fragment as they
// lie and the product sums each key with its own row of V. Keys past Sk are zeros. Grid: (padded Sk / 32,
// D / 32, B * Hkv), a CTA for each 32 x 32 block through shared memory, so that both its reads (along D) and
// its writes (along the keys) take whole rows.
#include "common.cuh"

using namespace csa;

static_assert(CSA_DTYPE_F32, "the transposed copy serves TF32's products");
static_assert(TILE_M == 32 && TILE_N == 32, "a CTA copies 32 keys (a warp's lanes) of 32 head dims");

extern "C" __global__ void __launch_bounds__(NWARPS * 32) csa_forward_vt(const __grid_constant__ Params p) {
    __shared__ float block[32][33];  // a 33-float row: the transposed reads fall in distinct banks
    const int heads_kv = p.heads_q / p.group, b = blockIdx.z / heads_kv, h = blockIdx.z % heads_kv;
    const int k0 = blockIdx.x * 32, d0 = blockIdx.y * 32, lane = threadIdx.x % 32;
    const elem_t* v = p.v + b * p.v_sb + h * p.v_sh;
    for (int r = threadIdx.x / 32; r < 32; r += NWARPS) {
        const int key = k0 + r;
        block[r][lane] = key < p.seq_k ? v[key * p.v_ss + d0 + lane] : 0.f;
    }
    __syncthreads();
    elem_t* vt = p.vt + b * p.vt_sb + h * p.vt_sh;
    const int key = (lane & ~7) | ((lane & 3) << 1) | ((lane >> 2) & 1);  // column `lane` holds this key
    for (int r = threadIdx.x / 32; r < 32; r += NWARPS)
        vt[(d0 + r) * p.vt_ss + k0 + lane] = block[key][r];
}
