// The kernels' parameters and the work a CTA takes: the Params struct every pass gets by value, the spans of
// the layout's tile table, and the persistent passes' walk over their work items. Included by common.cuh after
// its element types, which the parameters' pointers take.
#pragma once

namespace csa {

// Kernel parameters of every pass, passed by value. Strides are in elements; 64-bit so that B*H*S*D may exceed
// 2^31. cusparseattn.c_structs reads this definition into the NumPy dtype that the launches fill.
struct Params {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* lse;
    const elem_t* dout;  // the backward's inputs and outputs (null in the forward)
    elem_t* dq;
    elem_t* dk;
    elem_t* dv;
    float* stats;        // [B, Hq, 2 (+ HEAD_DIM + 1), padded Sq]: per query row lse * log2(e) and delta =
                         // rowsum(dout * out) (STAT_LSE2, STAT_DELTA), written by the dQ pass (or the
                         // statistics pass), read by the dK/dV pass; the fused backward's dQ sums after them
    elem_t* vt;          // float32's Hopper passes: V, K, Q and dO transposed, [B, H, D, S padded]
    elem_t* kt;          // (transpose.cu)
    elem_t* qt;
    elem_t* dot;
    long long q_sb, q_sh, q_ss;
    long long k_sb, k_sh, k_ss;
    long long v_sb, v_sh, v_ss;
    long long o_sb, o_sh, o_ss;
    long long do_sb, do_sh, do_ss;
    long long dq_sb, dq_sh, dq_ss;
    long long dk_sb, dk_sh, dk_ss;
    long long dv_sb, dv_sh, dv_ss;
    long long lse_sb, lse_sh;
    long long stats_sb, stats_sh, stats_sr;  // stats_sr: from one statistic to the next, the padded length
    long long vt_sb, vt_sh, vt_ss;
    long long kt_sb, kt_sh, kt_ss;
    long long qt_sb, qt_sh, qt_ss;
    long long dot_sb, dot_sh, dot_ss;
    int seq_q, seq_k, heads_q, group;   // group = Hq / Hkv
    int layout_batch, layout_heads;      // 1 (shared) or B / Hq
    int tiles_q, tiles_k;
    int sub_q_shift, sub_k_shift, sub_k_count;  // layout blocks inside a kernel tile (log2 sizes, count per row)
    float scale;                                // softmax scale (of q . k)
    const int* row_ptr;                         // [layout_batch * layout_heads * tiles_q + 1]
    const int2* entries;                        // (key tile, partial index or -1)
    const int* col_ptr;                         // [layout_batch * layout_heads * tiles_k + 1]
    const int2* col_entries;                    // (query tile, partial index or -1)
    const ulonglong2* sub_bits;                 // per partial entry: layout blocks of the tile that are set (x)
                                                // and that are partial (y), one bit each, row-major
    const unsigned long long* bit_mask;         // RULE_BITS: per partial entry, TILE_M rows of TILE_N bits
    long long rule_p[8];                        // P0..P7 of the token rule
    const int* rule_a[4];                       // A0..A3 of the token rule
    long long q_origin, k_origin;               // global positions of query and key 0, for score mods
    long long score_ip[8];                      // SI0..SI7 of the score mod
    float score_fp[8];                          // SF0..SF7
    const void* score_a[4];                     // SA0..SA3 (the expression casts them to their element type)
    const int* work;                            // persistent passes: (batch, head, tile) items, heaviest first
    int work_count;
    int rule_narrow;                            // RULE_EXPR: evaluate the rule in int (cuda.py: rule_narrow)
    const int* col_start;                       // fused backward (schedule.column_schedule): per call column
    const long long* rank_ptr;                  // its first rank
    const int* ranks;                           // each visit's rank among its query tile's adds
    int dq_unordered;                           // fused backward: its dQ adds in any order (cuda.py)
    const int* parts;      // Hopper forward: each part of a split row: b, h, first query, first and end entry
    const int* split_ptr;  // its combine pass: split row s's parts are split_ptr[s] to split_ptr[s + 1]
};

// The layout's (batch, head) line for batch b, query head h: a shared layout has one line for all of them.
__device__ __forceinline__ int layout_line(const Params& p, int b, int h) {
    return (p.layout_batch > 1 ? b : 0) * p.layout_heads + (p.layout_heads > 1 ? h : 0);
}

// A span of the tile table's entries: the key tiles of one query tile's row (row_ptr / entries), or the query
// tiles of one key tile's column (col_ptr / col_entries), for batch b and query head h.
struct Span {
    int begin, count;
};
__device__ __forceinline__ Span row_span(const Params& p, int b, int h, int tile_q) {
    const int line = layout_line(p, b, h) * p.tiles_q + tile_q;
    return {p.row_ptr[line], p.row_ptr[line + 1] - p.row_ptr[line]};
}
__device__ __forceinline__ Span column_span(const Params& p, int b, int h, int tile_k) {
    const int line = layout_line(p, b, h) * p.tiles_k + tile_k;
    return {p.col_ptr[line], p.col_ptr[line + 1] - p.col_ptr[line]};
}

// SPLIT_ROWS: the Hopper forward's deal splits rows (build.KernelSpec.split_rows); the other passes walk none.
#ifndef SPLIT_ROWS
#define SPLIT_ROWS 0
#endif

// A persistent pass's work item with its row of the layout: batch element, query head, first query and the
// row's span of entries (a part of a split row: its part of them).
struct Row {
    int b, h, q0, begin, end;  // end, not a count: taking a row does no arithmetic on loads still in flight
    int part;                  // of a split row (schedule.work_order; its slot of the scratch), or -1
};

// A persistent CTA's work items: entries blockIdx.x, blockIdx.x + gridDim.x, ... of the work list (cuda.py:
// item = (b * heads_q + h) * tiles_q + tile, or -2 - p for part p of a split row), up to a -1. Read ahead:
// when one starts, the next one's row and the item after it are already loaded, so no item waits on a global
// load to begin.
struct Walk {
    int w, ahead;  // ahead: the item at w + gridDim.x, -1 past the last
    Row next;      // the item at w; b = -1 past the last

    __device__ __forceinline__ static int item_at(const Params& p, int w) {
        return w < p.work_count ? p.work[w] : -1;
    }
    __device__ __forceinline__ static Row row_of(const Params& p, int item) {
        if (SPLIT_ROWS ? item == -1 : item < 0) return {-1, 0, 0, 0, 0, -1};
        if (item < 0) {
            const int* part = p.parts + 5 * (-2 - item);
            return {part[0], part[1], part[2], part[3], part[4], -2 - item};
        }
        const int tile = item % p.tiles_q, h = (item / p.tiles_q) % p.heads_q, b = item / (p.tiles_q * p.heads_q);
        const int line = layout_line(p, b, h) * p.tiles_q + tile;
        return {b, h, tile * TILE_M, p.row_ptr[line], p.row_ptr[line + 1], -1};
    }
    __device__ __forceinline__ explicit Walk(const Params& p)
        : w(blockIdx.x), ahead(item_at(p, blockIdx.x + gridDim.x)), next(row_of(p, item_at(p, blockIdx.x))) {}
    __device__ __forceinline__ bool done() const { return next.b < 0; }
    __device__ __forceinline__ Row take(const Params& p) {
        const Row row = next;
        next = row_of(p, ahead);
        w += gridDim.x;
        ahead = item_at(p, w + gridDim.x);
        return row;
    }
};

// The query tile of a CTA of the row-walking passes (grid: query tiles, query heads, batch elements): the
// heaviest rows of causal-like layouts are the last ones, so they start first.
__device__ __forceinline__ int query_tile(const Params& p) { return p.tiles_q - 1 - blockIdx.x; }

}  // namespace csa
