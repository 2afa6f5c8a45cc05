// float32's Hopper passes multiply in TF32, whose wgmma reads both shared operands K-major: where a product
// reduces over an array's rows (P V in the forward, dS K in the dQ pass, P^T dO and dS^T Q in the dK/dV pass),
// it reads the array's transposed copy (hopper.cuh: B_TRANSPOSED). This pass, launched before them, makes the
// copies a call binds (a null destination is skipped): V to vt and K to kt [B, Hkv, D, Sk padded to 32], Q to qt
// and dO to dot [B, Hq, D, Sq padded to 32] (the TMA copies that read them round to TF32: tma.py). The rows of
// each 8 go in the order 0, 2, 4, 6, 1, 3, 5, 7: a TF32 A fragment holds a quad's columns t and t + 4 where an
// accumulator holds 2t and 2t + 1 (hopper.cuh's a_fragment), so that the accumulator's registers are the
// fragment as they lie and the product sums each column with its own row of the copy. Rows past the length
// are zeros. Grid: (padded longest length / 32 * D / 32, the bound copies' heads, B), as the other passes'
// grids heads on y and the batch on z; a CTA for each 32 x 32 block through shared memory, so that both its
// reads (along D) and its writes (along the rows) take whole rows.
#include "common.cuh"

using namespace csa;

static_assert(CSA_DTYPE_F32, "the transposed copies serve TF32's products");
static_assert(TILE_M == 32 && TILE_N == 32, "a CTA copies 32 rows (a warp's lanes) of 32 head dims");

// One copy: its source's and destination's pointers and strides (batch, head, row), heads and rows.
struct Copy {
    const elem_t* src;
    long long sb, sh, ss;
    elem_t* dst;
    long long db, dh, ds;
    int heads, rows;
};

__device__ __forceinline__ Copy copy_of(const Params& p, int c) {
    const int heads_kv = p.heads_q / p.group;
    switch (c) {
        case 0: return {p.v, p.v_sb, p.v_sh, p.v_ss, p.vt, p.vt_sb, p.vt_sh, p.vt_ss, heads_kv, p.seq_k};
        case 1: return {p.k, p.k_sb, p.k_sh, p.k_ss, p.kt, p.kt_sb, p.kt_sh, p.kt_ss, heads_kv, p.seq_k};
        case 2: return {p.q, p.q_sb, p.q_sh, p.q_ss, p.qt, p.qt_sb, p.qt_sh, p.qt_ss, p.heads_q, p.seq_q};
        default:
            return {p.dout, p.do_sb, p.do_sh, p.do_ss, p.dot, p.dot_sb, p.dot_sh, p.dot_ss, p.heads_q, p.seq_q};
    }
}
extern "C" __global__ void __launch_bounds__(NWARPS * 32) csa_transpose(const __grid_constant__ Params p) {
    __shared__ float block[32][33];  // a 33-float row: the transposed reads fall in distinct banks
    // blockIdx.y = the head among the bound copies' heads, copy by copy in copy_of's order.
    const int b = blockIdx.z;
    int h = blockIdx.y, c = 0;
    Copy x = copy_of(p, 0);
    for (; !x.dst || h >= x.heads; x = copy_of(p, ++c)) h -= x.dst ? x.heads : 0;
    constexpr int D_BLOCKS = HEAD_DIM / 32;
    const int r0 = blockIdx.x / D_BLOCKS * 32, d0 = blockIdx.x % D_BLOCKS * 32, lane = threadIdx.x % 32;
    if (r0 >= x.rows) return;  // past this copy's padded rows (r0 is a multiple of 32)
    const elem_t* src = x.src + b * x.sb + h * x.sh;
    for (int r = threadIdx.x / 32; r < 32; r += NWARPS) {
        const int row = r0 + r;
        block[r][lane] = row < x.rows ? src[row * x.ss + d0 + lane] : 0.f;
    }
    __syncthreads();
    elem_t* dst = x.dst + b * x.db + h * x.dh;
    const int row = (lane & ~7) | ((lane & 3) << 1) | ((lane >> 2) & 1);  // column `lane` holds this row
    for (int r = threadIdx.x / 32; r < 32; r += NWARPS) dst[(d0 + r) * x.ds + r0 + lane] = block[row][r];
}
