// The tile tables of a dynamic layout, built on the GPU at every call from the caller's index arrays: what
// the attention passes read of a layout (params.cuh: row_ptr, entries, col_ptr, col_entries, sub_bits), for
// the selection (chosen & within) | plus of cusparseattn.dynamic, with chosen per query block.
//
// One kernel, launched once per step on the call's stream (TablesParams.step), each step reading what the
// last wrote; nothing is read back on the host. The tables come out as the host's plan (cusparseattn.plan)
// would make them for the same selection: rows in key-tile order, columns in query-tile order, a partial
// tile's index its place among the row entries. Integer atomics only count and set bits, so the tables are
// the same bits at every run.
//   0. chosen: per (selection line, query block) a bitmap of the key blocks its valid entries name (an
//      entry that is negative, past the key blocks or past the row's count is ignored; a repeat sets the
//      same bit); and the column counts zeroed.
//   1. tiles: per (table line, query tile), for every key tile, whether any of its cells is set (visited)
//      and whether it is partial, as bitmaps; the row's count; each visited tile counted in its column.
//   2. scan: row_ptr and col_ptr from the counts (a CTA each).
//   3. rows: per row (a warp each), the entries in key-tile order and a partial tile's sub_bits.
//   4. columns: per (table line, key tile), a warp walks the query tiles in order and writes col_entries.
struct TablesParams {
    const int* indices;  // [sel_batch, sel_heads, n_qb, width], strides in elements
    const int* counts;   // [sel_batch, sel_heads, n_qb], or null
    long long i_sb, i_sh, i_sr, i_sk;
    long long c_sb, c_sh, c_sr;
    const unsigned char* within;  // [w_batch, w_heads, n_qb, n_kb]: 0 none, 1 full, 2 partial; null: all full
    const unsigned char* plus;    // [p_batch, p_heads, n_qb, n_kb], or null: none
    unsigned* chosen;             // [sel_batch * sel_heads, n_qb, words]
    unsigned* visited;            // [lines, tiles_q, tile_words]
    unsigned* partial;            // [lines, tiles_q, tile_words]
    int* row_count;               // [lines * tiles_q]
    int* col_count;               // [lines * tiles_k]
    int* row_ptr;                 // [lines * tiles_q + 1]
    int* col_ptr;                 // [lines * tiles_k + 1]
    int2* entries;                // (key tile, partial index or -1), at most `capacity`
    int2* col_entries;            // (query tile, partial index or -1)
    unsigned long long* sub_bits; // [capacity, 2]: set cells, partial cells
    int sel_batch, sel_heads, sel_group;  // query head h reads selection head h / sel_group (sel_heads > 1)
    int w_batch, w_heads, p_batch, p_heads;
    int lines_batch, lines_heads;  // the tables' lines (the passes' layout_batch, layout_heads)
    int n_qb, n_kb, width, words;
    int block_q, block_k, cell_q, cell_k, per_q, per_k, cell_rows, cell_cols;
    int tiles_q, tiles_k, tile_words, tile_n, seq_k, capacity;
    int step;
};

constexpr int THREADS = 256;
enum { NONE = 0, FULL = 1, PARTIAL = 2 };

// The state of cell (rr, cc) of table line (b, h): none, full or partial, from its layout block's.
__device__ __forceinline__ int cell_state(const TablesParams& p, int b, int h, int rr, int cc) {
    const int i = (int)((long long)rr * p.cell_q / p.block_q), j = (int)((long long)cc * p.cell_k / p.block_k);
    const int sel = (p.sel_batch > 1 ? b : 0) * p.sel_heads + (p.sel_heads > 1 ? h / p.sel_group : 0);
    const bool chosen = (p.chosen[((long long)sel * p.n_qb + i) * p.words + (j >> 5)] >> (j & 31)) & 1u;
    const long long at = (long long)i * p.n_kb + j;
    const int w = p.within ? p.within[((long long)(p.w_batch > 1 ? b : 0) * p.w_heads + (p.w_heads > 1 ? h : 0))
                                          * p.n_qb * p.n_kb + at]
                           : FULL;
    const int x = p.plus ? p.plus[((long long)(p.p_batch > 1 ? b : 0) * p.p_heads + (p.p_heads > 1 ? h : 0))
                                      * p.n_qb * p.n_kb + at]
                         : NONE;
    if ((chosen && w == FULL) || x == FULL) return FULL;
    return (chosen && w != NONE) || x != NONE ? PARTIAL : NONE;
}

struct TileState {
    bool visited, partial;
    unsigned long long set_bits, partial_bits;  // row-major over the tile's cells
};

// Tile (tq, tk) of table line `line`: visited when a cell is set, full when every cell is (rows past the
// queries' end count as full: nothing is written for them) and the tile ends before the keys do.
__device__ TileState tile_state(const TablesParams& p, int line, int tq, int tk) {
    const int b = line / p.lines_heads, h = line % p.lines_heads;
    TileState t{false, false, 0ull, 0ull};
    bool all_full = (tk + 1) * (long long)p.tile_n <= p.seq_k;
    for (int a = 0; a < p.per_q; ++a) {
        const int rr = tq * p.per_q + a;
        for (int c = 0; c < p.per_k; ++c) {
            const int cc = tk * p.per_k + c;
            if (rr >= p.cell_rows) continue;
            const int s = cc < p.cell_cols ? cell_state(p, b, h, rr, cc) : NONE;
            const unsigned long long bit = 1ull << (a * p.per_k + c);
            if (s != NONE) t.set_bits |= bit;
            if (s == PARTIAL) t.partial_bits |= bit;
            all_full &= s == FULL;
        }
    }
    t.visited = t.set_bits != 0;
    t.partial = t.visited && !all_full;
    return t;
}

__device__ void choose(const TablesParams& p) {
    const int row = blockIdx.x, sel = blockIdx.y;
    unsigned* bits = p.chosen + ((long long)sel * p.n_qb + row) * p.words;
    for (int w = threadIdx.x; w < p.words; w += blockDim.x) bits[w] = 0u;
    const long long flat = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    const long long columns = (long long)p.lines_batch * p.lines_heads * p.tiles_k;
    for (long long c = flat; c < columns; c += (long long)gridDim.x * gridDim.y * blockDim.x) p.col_count[c] = 0;
    __syncthreads();
    const int b = sel / p.sel_heads, h = sel % p.sel_heads;
    int count = p.width;
    if (p.counts) count = min(max(p.counts[b * p.c_sb + h * p.c_sh + row * p.c_sr], 0), p.width);
    const int* entries = p.indices + b * p.i_sb + h * p.i_sh + row * p.i_sr;
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
        const int block = entries[j * p.i_sk];
        if (block >= 0 && block < p.n_kb) atomicOr(bits + (block >> 5), 1u << (block & 31));
    }
}

__device__ void classify(const TablesParams& p) {
    const int tq = blockIdx.x, line = blockIdx.y, lane = threadIdx.x & 31;
    const long long row = (long long)line * p.tiles_q + tq;
    __shared__ int visits;
    if (threadIdx.x == 0) visits = 0;
    __syncthreads();
    for (int base = 0; base < p.tile_words * 32; base += blockDim.x) {
        const int tk = base + threadIdx.x;
        const TileState t = tk < p.tiles_k ? tile_state(p, line, tq, tk) : TileState{false, false, 0ull, 0ull};
        const unsigned visited = __ballot_sync(~0u, t.visited), partial = __ballot_sync(~0u, t.partial);
        if (t.visited) atomicAdd(p.col_count + (long long)line * p.tiles_k + tk, 1);
        const int word = tk >> 5;
        if (lane == 0 && word < p.tile_words) {
            p.visited[row * p.tile_words + word] = visited;
            p.partial[row * p.tile_words + word] = partial;
            atomicAdd(&visits, __popc(visited));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) p.row_count[row] = visits;
}

// Exclusive scan of counts[0..n) into ptr[0..n], one CTA: each thread sums a run, a scan of the runs' sums
// gives each run its start.
__device__ void scan(const int* counts, int* ptr, int n) {
    __shared__ int sums[THREADS];
    const int run = (n + THREADS - 1) / THREADS, first = threadIdx.x * run, last = min(first + run, n);
    int sum = 0;
    for (int i = first; i < last; ++i) sum += counts[i];
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int offset = 1; offset < THREADS; offset <<= 1) {
        const int add = threadIdx.x >= offset ? sums[threadIdx.x - offset] : 0;
        __syncthreads();
        sums[threadIdx.x] += add;
        __syncthreads();
    }
    int at = sums[threadIdx.x] - sum;
    for (int i = first; i < last; ++i) {
        ptr[i] = at;
        at += counts[i];
    }
    if (threadIdx.x == THREADS - 1) ptr[n] = sums[THREADS - 1];
}

__device__ void write_rows(const TablesParams& p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tq = blockIdx.x * (THREADS / 32) + warp, line = blockIdx.y;
    if (tq >= p.tiles_q) return;
    const long long row = (long long)line * p.tiles_q + tq;
    int at = p.row_ptr[row];
    for (int word = 0; word < p.tile_words; ++word) {
        const unsigned visited = p.visited[row * p.tile_words + word];
        const unsigned partial = p.partial[row * p.tile_words + word];
        const int tk = word * 32 + lane;
        if ((visited >> lane) & 1u) {
            const int e = at + __popc(visited & ((1u << lane) - 1u));
            if (e < p.capacity) {
                const bool is_partial = (partial >> lane) & 1u;
                p.entries[e] = make_int2(tk, is_partial ? e : -1);
                if (is_partial) {
                    const TileState t = tile_state(p, line, tq, tk);
                    p.sub_bits[2 * (long long)e] = t.set_bits;
                    p.sub_bits[2 * (long long)e + 1] = t.partial_bits;
                }
            }
        }
        at += __popc(visited);
    }
}

__device__ void write_columns(const TablesParams& p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tk = blockIdx.x * (THREADS / 32) + warp, line = blockIdx.y;
    if (tk >= p.tiles_k) return;
    const int word = tk >> 5, bit = tk & 31;
    int at = p.col_ptr[(long long)line * p.tiles_k + tk];
    for (int base = 0; base < p.tiles_q; base += 32) {
        const int tq = base + lane;
        const long long row = (long long)line * p.tiles_q + tq;
        const unsigned visited = tq < p.tiles_q ? p.visited[row * p.tile_words + word] : 0u;
        const bool here = (visited >> bit) & 1u;
        const unsigned column = __ballot_sync(~0u, here);
        if (here) {
            int index = -1;
            if ((p.partial[row * p.tile_words + word] >> bit) & 1u) {
                index = p.row_ptr[row] + __popc(visited & ((1u << bit) - 1u));
                for (int w = 0; w < word; ++w) index += __popc(p.visited[row * p.tile_words + w]);
            }
            const int e = at + __popc(column & ((1u << lane) - 1u));
            if (e < p.capacity) p.col_entries[e] = make_int2(tq, index < p.capacity ? index : -1);
        }
        at += __popc(column);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) csa_dynamic_tables(const __grid_constant__ TablesParams p) {
    switch (p.step) {
        case 0: choose(p); break;
        case 1: classify(p); break;
        case 2:  // two CTAs: the rows' scan and the columns'
            if (blockIdx.x == 0) scan(p.row_count, p.row_ptr, p.lines_batch * p.lines_heads * p.tiles_q);
            else scan(p.col_count, p.col_ptr, p.lines_batch * p.lines_heads * p.tiles_k);
            break;
        case 3: write_rows(p); break;
        default: write_columns(p); break;
    }
}
