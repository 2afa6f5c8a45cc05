// The backward passes' shared helpers: the statistics rows (lse, delta, the dQ sums) of the scratch and what
// the dQ and dK/dV passes compute from them. Included at the end of common.cuh, whose definitions it uses.
#pragma once

#include "common.cuh"

namespace csa {

// ---- the backward ------------------------------------------------------------------------------------------
enum Stat { STAT_LSE2 = 0, STAT_DELTA = 1, STAT_DQ = 2 };
__device__ __forceinline__ float* stat_row(const Params& p, int b, int h, Stat stat) {
    return p.stats + b * p.stats_sb + h * p.stats_sh + stat * p.stats_sr;
}
// The fused backward's scratch past the statistics: HEAD_DIM rows that hold the fp32 dQ sums as
// [query tile][HEAD_DIM / 8][TILE_M][8] (the padded length holds whole tiles), then a row of int counters, one
// per query tile: the adds done so far (zeroed by the statistics pass). Eight columns of a row are 32 bytes
// apart from the next row's: a warp's store of its accumulators' eight rows (two columns a thread) is 256
// contiguous bytes, where row-major rows fell on the same shared-memory banks (four ways).
__device__ __forceinline__ float* dq_sum(const Params& p, int b, int h, int tile_q) {
    return stat_row(p, b, h, STAT_DQ) + (long long)tile_q * TILE_M * HEAD_DIM;
}
__device__ __forceinline__ int* dq_counters(const Params& p, int b, int h) {
    return reinterpret_cast<int*>(stat_row(p, b, h, STAT_DQ) + (long long)HEAD_DIM * p.stats_sr);
}

// The dQ pass's statistics of the warp's 16 rows from row0, returned for rows g and g + 8 (the rows of the
// thread's accumulators) and written out for the dK/dV pass, over the whole padded length (rows past the
// sequence too, so that a tile copied whole holds no garbage):
// - delta = rowsum(dO * O) in fp32. Lanes 2r and 2r + 1 share row r, a chunk (16 bytes) per load.
// - lse2 = lse * log2(e): +inf past the sequence and for rows that attend to nothing (lse = -inf), so that
//   exp2(s - lse2) gives P = 0 there.
__device__ __forceinline__ void row_stats(const Params& p, int b, int h, int row0, int lane, float (&lse2)[2],
                                          float (&delta)[2]) {
    const int r = lane >> 1, q = row0 + r;
    float sum = 0.f;
    if (q < p.seq_q) {
        const elem_t* o_row = p.o + b * p.o_sb + h * p.o_sh + (long long)q * p.o_ss;
        const elem_t* do_row = p.dout + b * p.do_sb + h * p.do_sh + (long long)q * p.do_ss;
        for (int c = (lane & 1) * CHUNK; c < HEAD_DIM_REAL; c += 2 * CHUNK) {
            const uint4 ov = *reinterpret_cast<const uint4*>(o_row + c);
            const uint4 dv = *reinterpret_cast<const uint4*>(do_row + c);
            const elem2_t* o2 = reinterpret_cast<const elem2_t*>(&ov);
            const elem2_t* d2 = reinterpret_cast<const elem2_t*>(&dv);
#pragma unroll
            for (int j = 0; j < CHUNK / 2; ++j) {
                const float2 of = unpack2(o2[j]), df = unpack2(d2[j]);
                sum = fmaf(of.x, df.x, fmaf(of.y, df.y, sum));
            }
        }
    }
    sum = lanes_sum<2>(sum);
    const float lse = q < p.seq_q ? p.lse[b * p.lse_sb + h * p.lse_sh + q] : -INFINITY;
    const float l2 = lse == -INFINITY ? INFINITY : lse * LOG2E;
    if (q < p.stats_sr) stat_row(p, b, h, (lane & 1) ? STAT_LSE2 : STAT_DELTA)[q] = (lane & 1) ? l2 : sum;
    const int g = lane >> 2;
    delta[0] = __shfl_sync(0xffffffffu, sum, 2 * g);
    delta[1] = __shfl_sync(0xffffffffu, sum, 2 * (g + 8));
    lse2[0] = __shfl_sync(0xffffffffu, l2, 2 * g);
    lse2[1] = __shfl_sync(0xffffffffu, l2, 2 * (g + 8));
}

// The dQ pass's dS = P * (dP - delta) in place of the masked scores s of a warp's rows, P = exp2(s * scale_log2
// - lse2); dp as apply_score_mod left it.
template <int COLS>
__device__ __forceinline__ void scores_to_ds(float (&s)[COLS / 8][4], const float (&dp)[COLS / 8][4],
                                             const float (&lse2)[2], const float (&delta)[2], float scale_log2) {
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float prob = exp2f(fmaf(s[n][j], scale_log2, -lse2[j >> 1]));
            s[n][j] = dscore(prob, dp[n][j], delta[j >> 1]);
        }
}

// P^T = exp2(S^T * scale_log2 - lse2) in place of S^T (a warp's 16 keys by COLS queries, whose lse2 lies in
// shared memory), where the partial tile's mask (keep: its mask_bits) lets it through. t: the thread's place in
// its quad (lane & 3).
template <int COLS>
__device__ __forceinline__ void transposed_probs(float (&st)[COLS / 8][4], const float* lse2, bool partial,
                                                 const ElementBits<COLS>& keep, float scale_log2, int t) {
    if (partial) apply_mask<COLS>(st, keep);
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) st[c][jj] = exp2f(fmaf(st[c][jj], scale_log2, -lse2[c * 8 + 2 * t + (jj & 1)]));
}

// dS^T = P^T * (dP^T - delta) in place of dP^T, from transposed_probs's P^T (delta in shared memory).
template <int COLS>
__device__ __forceinline__ void transposed_ds(const float (&pt)[COLS / 8][4], float (&dpt)[COLS / 8][4],
                                              const float* delta, int t) {
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) dpt[c][jj] = dscore(pt[c][jj], dpt[c][jj], delta[c * 8 + 2 * t + (jj & 1)]);
}

// The dK/dV passes' P^T and dS^T in place of S^T and dP^T, once those have landed: the score mod, then
// transposed_probs and transposed_ds. Without a score mod the fused backward runs the two apart, P^T while
// dP^T's product is in flight.
template <int COLS>
__device__ __forceinline__ void transposed_scores_to_ds(const Params& p, float (&st)[COLS / 8][4],
                                                        float (&dpt)[COLS / 8][4], const float* lse2,
                                                        const float* delta, bool partial, const ElementBits<COLS>& keep,
                                                        float scale_log2, int b, int h, const TilePos<true>& pos,
                                                        int t) {
    apply_score_mod<true, COLS>(p, st, dpt, [&](int c, int jj) { return delta[c * 8 + 2 * t + (jj & 1)]; }, b, h, pos);
    transposed_probs<COLS>(st, lse2, partial, keep, scale_log2, t);
    transposed_ds<COLS>(st, dpt, delta, t);
}

// P^T and dS^T, made without the mask (transposed_probs and transposed_ds), set to 0 where `bits` (from
// mask_bits) hides them: exp2 may have overflowed there, as the row's lse leaves out what the mask hides.
template <int COLS>
__device__ __forceinline__ void zero_hidden(float (&pt)[COLS / 8][4], float (&dst)[COLS / 8][4],
                                            const ElementBits<COLS>& bits) {
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (!bits.at(c, j)) pt[c][j] = dst[c][j] = 0.f;
}

}  // namespace csa
