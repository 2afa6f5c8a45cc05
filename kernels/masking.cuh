// What a partial tile keeps and how a score is modified: the token mask of a partial tile (its blocks' bits, the
// rule's C expression or the tile's bit mask, a band's bounds) and the score mods with their derivatives, over
// the accumulator fragments of the kernels' MMAs. Included at the end of common.cuh, whose definitions it uses.
#pragma once

#include "common.cuh"

namespace csa {

// ---- token mask of a partial tile ---------------------------------------------------------------------------
#if RULE_MODE == RULE_EXPR
// The rule at one token pair in RuleInt arithmetic (the builder's P0..P7 take that type too): long long, or
// int where the expression allows it (RULE_NARROWABLE: sums and comparisons) and the host found its values
// small enough to stay exact (Params::rule_narrow), which halves its instructions.
template <typename RuleInt>
__device__ __forceinline__ bool rule_at(const Params& p, int b, int h, int q, int k) {
    return CSA_RULE(static_cast<RuleInt>(b), static_cast<RuleInt>(h), static_cast<RuleInt>(q),
                    static_cast<RuleInt>(k));
}
#endif

// Whether query q0 + qi sees key k0 + ki, for tile-local (qi, ki) of the partial tile `pidx` whose sub-block
// bits are `sub` (ignored in RULE_BITS mode).
__device__ __forceinline__ bool visible(const Params& p, int pidx, const ulonglong2& sub, int b, int h, int q0,
                                        int k0, int qi, int ki) {
#if RULE_MODE == RULE_BITS
    // The host folded layout blocks, the rule and the sequence end into one bit per token pair.
    constexpr int WORDS = (TILE_N + 63) / 64;
    const unsigned long long word = p.bit_mask[((long long)pidx * TILE_M + qi) * WORDS + (ki >> 6)];
    return (word >> (ki & 63)) & 1ull;
#else
    const int kc = k0 + ki;
    const int bit = (qi >> p.sub_q_shift) * p.sub_k_count + (ki >> p.sub_k_shift);
    bool ok = kc < p.seq_k && ((sub.x >> bit) & 1ull);
#if RULE_MODE == RULE_EXPR
    // The rule decides only inside partial blocks; full blocks of the same tile attend whole.
    ok = ok && (!((sub.y >> bit) & 1ull) || rule_at<long long>(p, b, h, q0 + qi, kc));
#endif
    return ok;
#endif
}

// Calls f(n, j, row, col) for each element [n][j] of a warp's 16 x COLS accumulator tile, at tile-local row and
// column (rows from row0).
template <int COLS, class F>
__device__ __forceinline__ void for_each_element(int row0, int lane, F&& f) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < 2; ++c) f(n, 2 * r + c, row0 + g + 8 * r, n * 8 + 2 * t + c);
}

// One bit for each element of a warp's 16 x COLS accumulator tile: element [n][2r + c] (the thread's row r,
// column 8n + 2t + c) at bit 32r + 2(n % 16) + c of word n / 16, so that a word's halves are the thread's two
// rows of 128 columns in columns_before's order (band_bits). Unrolled loops index it with constants, so the
// words stay in registers.
template <int COLS>
struct ElementBits {
    unsigned long long word[(COLS + 127) / 128] = {};

    __device__ static constexpr int bit(int n, int j) { return 32 * (j >> 1) + 2 * (n % 16) + (j & 1); }
    __device__ __forceinline__ void set(int n, int j, bool on) {
        word[n / 16] |= (unsigned long long)on << bit(n, j);
    }
    __device__ __forceinline__ bool at(int n, int j) const { return (word[n / 16] >> bit(n, j)) & 1ull; }
};

// mask_bits's loop: visible_at(tile-local query, tile-local key) of each of the warp's elements.
template <bool TRANSPOSED, int COLS, class Visible>
__device__ __forceinline__ ElementBits<COLS> gather_bits(int row0, int lane, Visible visible_at) {
    ElementBits<COLS> bits;
    for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
        bits.set(n, j, TRANSPOSED ? visible_at(col, row) : visible_at(row, col));
    });
    return bits;
}

#if RULE_MODE == RULE_EXPR
// Whether the rule alone decides partial tile (sub-block bits `sub`) from key k0: every layout block of the tile
// partial and every key inside the sequence (the diagonal and window-edge tiles of causal and local layouts).
// There the per-element block bits can be skipped; they cost several times the rule's own arithmetic.
__device__ __forceinline__ bool rule_decides(const Params& p, const ulonglong2& sub, int k0) {
    const int cells = (TILE_M >> p.sub_q_shift) * p.sub_k_count;
    const unsigned long long all = cells >= 64 ? ~0ull : (1ull << cells) - 1;
    return sub.x == all && sub.y == all && k0 + TILE_N <= p.seq_k;
}
#endif

// The sub-block bits of partial tile `pidx` (visible): which layout blocks of the tile are set and which are
// partial. The bit table of RULE_BITS decides alone.
__device__ __forceinline__ ulonglong2 sub_bits_of(const Params& p, int pidx) {
#if RULE_MODE == RULE_BITS
    return make_ulonglong2(0, 0);
#else
    return p.sub_bits[pidx];
#endif
}

// `visible` at each of the warp's elements of partial tile `pidx` (sub-block bits `sub`), as mask_bits lays
// them out.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ ElementBits<COLS> block_bits(const Params& p, int pidx, const ulonglong2& sub, int b,
                                                        int h, int q0, int k0, int row0, int lane) {
    return gather_bits<TRANSPOSED, COLS>(row0, lane,
                                         [&](int qi, int ki) { return visible(p, pidx, sub, b, h, q0, k0, qi, ki); });
}

#if RULE_BAND || RULE_QBAND
// The elements of a thread's share of a warp's row of 128 columns (bit 2n + c: column 8n + 2t + c, t = lane % 4)
// that lie before column x: the bits below their count, so that ptxas selects the elements by their bits (R2P,
// seven predicates an instruction) instead of comparing each column. __funnelshift_lc clamps the count to 32.
__device__ __forceinline__ unsigned columns_before(int x, int t) {
    const int y = min(max(x - 2 * t, 0), 128);
    return __funnelshift_lc(~0u, 0u, (y >> 3) * 2 + min(y & 7, 2));
}

// The columns of a thread's share of 128 of a row's, from col0, that the rule's band lets through, as
// columns_before lays them out: rows are queries and columns keys (CSA_RULE_FIRST / LAST), or the transpose
// (CSA_RULE_QFIRST / QLAST, the backward's tiles whose rows are keys). 32-bit integers (TokenRule.narrow).
template <bool TRANSPOSED>
__device__ __forceinline__ unsigned band_columns(const Params& p, int b, int h, int row, int col0, int t) {
    using RuleInt = int;
    unsigned keep = ~0u;
    if constexpr (TRANSPOSED) {
        [[maybe_unused]] const int k = row;
#ifdef CSA_RULE_QLAST
        keep &= columns_before(CSA_RULE_QLAST(b, h, k) + 1 - col0, t);
#endif
#ifdef CSA_RULE_QFIRST
        keep &= ~columns_before(CSA_RULE_QFIRST(b, h, k) - col0, t);
#endif
    } else {
        [[maybe_unused]] const int q = row;
#ifdef CSA_RULE_LAST
        keep &= columns_before(CSA_RULE_LAST(b, h, q) + 1 - col0, t);
#endif
#ifdef CSA_RULE_FIRST
        keep &= ~columns_before(CSA_RULE_FIRST(b, h, q) - col0, t);
#endif
    }
    return keep;
}

// mask_bits where the rule alone decides and is a band: each of the thread's rows from its two ends, where the
// rule at each element took several times the instructions.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ ElementBits<COLS> band_bits(const Params& p, int b, int h, int q0, int k0, int row0,
                                                       int lane) {
    const int g = lane >> 2, t = lane & 3;
    ElementBits<COLS> bits;
#pragma unroll
    for (int w = 0; w < (COLS + 127) / 128; ++w)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = (TRANSPOSED ? k0 : q0) + row0 + g + 8 * r, col0 = (TRANSPOSED ? q0 : k0) + 128 * w;
            bits.word[w] |= (unsigned long long)band_columns<TRANSPOSED>(p, b, h, row, col0, t) << (32 * r);
        }
    return bits;
}
#endif

// Which elements of a warp's 16 x COLS accumulator tile are visible (ElementBits), in partial tile `pidx` of
// the plan; none for a full tile (pidx < 0), which is applied no mask.
// Rows are queries and columns keys, or the transpose (the dK/dV pass); `row0` is the warp's first row in the
// tile. Computed before the scores exist, so that the rule's arithmetic does not compete with the score
// accumulators for registers.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ ElementBits<COLS> mask_bits(const Params& p, int pidx, int b, int h, int q0, int k0,
                                                       int row0, int lane) {
    if (pidx < 0) return {};
    const ulonglong2 sub = sub_bits_of(p, pidx);
#if RULE_MODE == RULE_EXPR
    if (rule_decides(p, sub, k0)) {
#if RULE_NARROWABLE
        if (p.rule_narrow) {
#if RULE_BAND || RULE_QBAND
            // Not at head dim 256, whose portable dK/dV pass (255 registers) spilled 4 bytes with it.
            if constexpr ((TRANSPOSED ? RULE_QBAND : RULE_BAND) && HEAD_DIM <= 128)
                return band_bits<TRANSPOSED, COLS>(p, b, h, q0, k0, row0, lane);
#endif
            return gather_bits<TRANSPOSED, COLS>(
                row0, lane, [&](int qi, int ki) { return rule_at<int>(p, b, h, q0 + qi, k0 + ki); });
        }
#endif
        return gather_bits<TRANSPOSED, COLS>(
            row0, lane, [&](int qi, int ki) { return rule_at<long long>(p, b, h, q0 + qi, k0 + ki); });
    }
#endif
    return block_bits<TRANSPOSED, COLS>(p, pidx, sub, b, h, q0, k0, row0, lane);
}

// ---- score mods ---------------------------------------------------------------------------------------------
// The global (query, key) positions of element [n][j] of a warp's 16 x COLS accumulator tile: rows are queries
// (or keys when TRANSPOSED) from row0 of the tile at (q_tile0, k_tile0); the layout's origin is added, so the
// window of a longer sequence sees that sequence's positions.
template <bool TRANSPOSED>
struct TilePos {
    long long q0, k0;

    __device__ __forceinline__ TilePos(const Params& p, int q_tile0, int k_tile0, int row0, int lane) {
        const int r = row0 + (lane >> 2), c = 2 * (lane & 3);
        q0 = p.q_origin + q_tile0 + (TRANSPOSED ? c : r);
        k0 = p.k_origin + k_tile0 + (TRANSPOSED ? r : c);
    }
    __device__ __forceinline__ long long q(int n, int j) const {
        return q0 + (TRANSPOSED ? n * 8 + (j & 1) : 8 * (j >> 1));
    }
    __device__ __forceinline__ long long k(int n, int j) const {
        return k0 + (TRANSPOSED ? 8 * (j >> 1) : n * 8 + (j & 1));
    }
};

// The factor the softmax applies to s: the scale, unless a score mod has applied it already.
__device__ __forceinline__ float softmax_scale(const Params& p) { return SCORE_MOD ? 1.f : p.scale; }

// s <- mod(scale * s) over a warp's raw scores (q . k); nothing without a score mod. The mask applies after
// it, so that no mod revives a masked score.
template <bool TRANSPOSED, int COLS>
__device__ __forceinline__ void apply_score_mod(const Params& p, float (&s)[COLS / 8][4], int b, int h,
                                                const TilePos<TRANSPOSED>& pos) {
#if SCORE_MOD
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            s[n][j] = CSA_SCORE((s[n][j] * p.scale), (long long)b, (long long)h, pos.q(n, j), pos.k(n, j));
#endif
}

// The backward's form: also dp <- (dp - delta) * mod'(scale * s), with delta(n, j) the delta of the element's
// query; `dscore` then finishes dS.
template <bool TRANSPOSED, int COLS, class Delta>
__device__ __forceinline__ void apply_score_mod(const Params& p, float (&s)[COLS / 8][4], float (&dp)[COLS / 8][4],
                                                Delta&& delta, int b, int h, const TilePos<TRANSPOSED>& pos) {
#if SCORE_MOD
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float x = s[n][j] * p.scale;
            const long long q = pos.q(n, j), k = pos.k(n, j);
            dp[n][j] = (dp[n][j] - delta(n, j)) * CSA_SCORE_GRAD(x, (long long)b, (long long)h, q, k);
            s[n][j] = CSA_SCORE(x, (long long)b, (long long)h, q, k);
        }
#endif
}

// dS = P * (dp - delta) of one element (before the softmax scale), from the dp that apply_score_mod left.
__device__ __forceinline__ float dscore(float prob, float dp, float delta) {
#if SCORE_MOD
    return prob > 0.f ? prob * dp : 0.f;  // the mod's derivative may be inf or NaN where P is 0
#else
    return prob * (dp - delta);
#endif
}

// Sets the scores that `bits` (from mask_bits) hides to -inf: exp2 then gives exactly 0.
template <int COLS>
__device__ __forceinline__ void apply_mask(float (&s)[COLS / 8][4], const ElementBits<COLS>& bits) {
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (!bits.at(n, j)) s[n][j] = -INFINITY;
}

#if RULE_BAND
// Sets to -inf the scores of a warp's 16 x COLS tile (rows from row0 of the query tile at q0, columns from key
// k0) outside the rule's band, in 32-bit integers (TokenRule.narrow): two numbers a row instead of the rule at
// each element, fewer instructions (docs/tuning.md: hide_outside_band).
template <int COLS>
__device__ __forceinline__ void hide_outside_band(const Params& p, float (&s)[COLS / 8][4], int b, int h, int q0,
                                                  int k0, int row0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = q0 + row0 + g + 8 * r;
#pragma unroll
        for (int w = 0; w < (COLS + 127) / 128; ++w) {
            const unsigned keep = band_columns<false>(p, b, h, q, k0 + 128 * w, t);
#pragma unroll
            for (int i = 0; i < 32 && 16 * w + i / 2 < COLS / 8; ++i)
                if (!((keep >> i) & 1u)) s[16 * w + i / 2][2 * r + i % 2] = -INFINITY;
        }
    }
}
#endif

// A partial tile's mask over a warp's 16 x COLS accumulator tile (rows are queries), in two halves around the
// wait for the scores. The constructor runs before it: the tile's cell bits or, for a bit table (RULE_BITS),
// the bits of every element (block_bits). hide(s) runs once the scores have landed and sets what the mask
// hides to -inf: where the rule alone decides the warp's rows, it evaluates the rule at each element as it
// selects it (a band, RULE_BAND: at each row's ends); else, for each 8 columns, it reads their cell's bits (set,
// decided by the rule) and evaluates the rule only inside cells that it decides. That takes a fraction of the
// instructions of gathering a bit for each element and applying them, which key tiles of 192 over blocks of
// 128 (cells of 64, a warp's row of them mixed: whole, empty, the rule's) paid in every tile that crossed a
// block's edge. Nothing for a full tile (pidx < 0).
//
// A warp's 16 rows lie in one row of the tile's cells (blocks are at least 16 long), so where the tile ends
// before the keys do, the warp's part may be whole (no mask), empty or all rule though the tile is not: a
// query tile of 192 rows over blocks of 128 is partial wherever it crosses a block's edge. A cell is at least
// 16 keys wide, so 8 columns lie in one, and a row of a tile of at most 256 keys holds at most 16 of them.
template <int COLS>
struct TileMask {
    int pidx;
#if RULE_MODE == RULE_BITS
    ElementBits<COLS> bits;
#else
    unsigned cells_set = 0, cells_rule = 0;  // the warp's row of cells, a bit each: set; decided by the rule
    bool inside = true, by_rule = false;     // the tile ends before the keys do; the rule decides every cell
#endif

    __device__ __forceinline__ TileMask(const Params& p, int pidx_, int b, int h, int q0, int k0, int row0, int lane)
        : pidx(pidx_) {
        static_assert(COLS <= 256, "a warp's row of cells fits 16 bits");
        if (pidx < 0) return;
        const ulonglong2 sub = sub_bits_of(p, pidx);
#if RULE_MODE == RULE_BITS
        bits = block_bits<false, COLS>(p, pidx, sub, b, h, q0, k0, row0, lane);
#else
        const int shift = (row0 >> p.sub_q_shift) * p.sub_k_count;
        const unsigned row = (1u << p.sub_k_count) - 1;
        cells_set = static_cast<unsigned>(sub.x >> shift) & row;
        cells_rule = static_cast<unsigned>(sub.y >> shift) & row;
        inside = k0 + TILE_N <= p.seq_k;
        if (inside && cells_set == row && cells_rule == 0) pidx = -1;
        by_rule = inside && cells_set == row && cells_rule == row;
#endif
    }

    __device__ __forceinline__ void hide(const Params& p, float (&s)[COLS / 8][4], int b, int h, int q0, int k0,
                                         int row0, int lane) const {
        if (pidx < 0) return;
#if RULE_MODE == RULE_BITS
        apply_mask<COLS>(s, bits);
#else
#if RULE_MODE == RULE_EXPR
        if (by_rule) {
#if RULE_NARROWABLE
            if (p.rule_narrow) {
#if RULE_BAND
                hide_outside_band<COLS>(p, s, b, h, q0, k0, row0, lane);
#else
                for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
                    if (!rule_at<int>(p, b, h, q0 + row, k0 + col)) s[n][j] = -INFINITY;
                });
#endif
                return;
            }
#endif
            for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
                if (!rule_at<long long>(p, b, h, q0 + row, k0 + col)) s[n][j] = -INFINITY;
            });
            return;
        }
#endif
        // Rows of mixed cells are rare (a tile across a block's edge, the sequence's end): the rule in long long
        // alone keeps the code small.
        for_each_element<COLS>(row0, lane, [&](int n, int j, int row, int col) {
            const int cell = (n * 8) >> p.sub_k_shift;
            bool visible = ((cells_set >> cell) & 1u) && (inside || k0 + col < p.seq_k);
#if RULE_MODE == RULE_EXPR
            visible = visible && (!((cells_rule >> cell) & 1u) || rule_at<long long>(p, b, h, q0 + row, k0 + col));
#endif
            if (!visible) s[n][j] = -INFINITY;
        });
#endif
    }
};

}  // namespace csa
