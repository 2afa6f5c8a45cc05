// The tile tables of a dynamic layout, built on the GPU at every call from the caller's index arrays: what
// the attention passes read of a layout (params.cuh: row_ptr, entries, col_ptr, col_entries, sub_bits), for
// the selection (chosen & within) | plus of cusparseattn.dynamic, with chosen per query block.
//
// One kernel, launched once per step on the call's stream (TablesParams.step), each step reading what the
// last wrote; nothing is read back on the host. Most steps give each warp a row or a word of one. The tables
// come out as the host's plan (cusparseattn.plan) would make them for the same selection: rows in key-tile
// order, columns in query-tile order, a partial tile's index its place among the row entries. Integer
// atomics only count and set bits, so the tables are the same bits at every run.
//   0. chosen: per (selection line, query block) a bitmap of the key blocks its valid entries name (an
//      entry that is negative, past the key blocks or past the row's count is ignored; a repeat sets the
//      same bit); and the counts zeroed.
//   1. tiles: per (table line, query tile), for every key tile, whether any of its cells is set (visited)
//      and whether it is partial, as bitmaps (a warp a word); counted in its row and its column.
//   2. scan: row_ptr and col_ptr from the counts (a CTA each); for the fused backward, rank_ptr and when its
//      deal reaches each item.
//   3. rows and columns: per row, its entries in key-tile order and a partial tile's sub_bits; per (table
//      line, key tile), its query tiles in order, written to col_entries.
//   4. (the fused backward's tables) each visit's rank among the adds into its query tile (rank_visits).
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
    // The fused backward's schedule (params.cuh: col_start, rank_ptr, ranks), made where `work` is given: its
    // deal of items (b * heads_kv + hk) * tiles_k + tile_k to `ctas` CTAs, `rounds` a CTA, -1 past the last.
    const int* work;
    long long* rank_ptr;  // [batch * heads_q * tiles_k + 1]: where each call column's ranks begin
    int* ranks;           // each visit's rank among the adds into its query tile, in the column's order
    int* col_pos;         // [capacity]: each entry's place in its column
    int* item_start;      // [items]: when its CTA reaches each item, in visits and item_cost each
    int* item_rank;       // [items]: its place in the deal
    int sel_batch, sel_heads, sel_group;  // query head h reads selection head h / sel_group (sel_heads > 1)
    int w_batch, w_heads, p_batch, p_heads;
    int lines_batch, lines_heads;  // the tables' lines (the passes' layout_batch, layout_heads)
    int n_qb, n_kb, width, words;
    int block_q, block_k, cell_q, cell_k, per_q, per_k, cell_rows, cell_cols;
    int tiles_q, tiles_k, tile_words, tile_n, seq_k, capacity;
    int batch, heads_q, group, ctas, rounds, item_cost;
    int step;
};

constexpr int THREADS = 256, WARPS = THREADS / 32;  // the CTAs of the steps that give each warp a row
constexpr int SCAN_THREADS = 1024;
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

// The warp's row in a step that gives each warp one (a query block, a query tile, a key tile), or -1 past
// the last.
__device__ __forceinline__ int warp_row(int rows) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    return row < rows ? row : -1;
}

__device__ void choose(const TablesParams& p) {
    const long long flat = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    const long long lines = (long long)p.lines_batch * p.lines_heads;
    const long long threads = (long long)gridDim.x * gridDim.y * blockDim.x;
    for (long long c = flat; c < lines * p.tiles_k; c += threads) p.col_count[c] = 0;
    for (long long r = flat; r < lines * p.tiles_q; r += threads) p.row_count[r] = 0;
    const int row = warp_row(p.n_qb), sel = blockIdx.y, lane = threadIdx.x & 31;
    if (row < 0) return;
    unsigned* bits = p.chosen + ((long long)sel * p.n_qb + row) * p.words;
    for (int w = lane; w < p.words; w += 32) bits[w] = 0u;
    __syncwarp();
    const int b = sel / p.sel_heads, h = sel % p.sel_heads;
    int count = p.width;
    if (p.counts) count = min(max(p.counts[b * p.c_sb + h * p.c_sh + row * p.c_sr], 0), p.width);
    const int* entries = p.indices + b * p.i_sb + h * p.i_sh + row * p.i_sr;
    for (int j = lane; j < count; j += 32) {
        const int block = entries[j * p.i_sk];
        if (block >= 0 && block < p.n_kb) atomicOr(bits + (block >> 5), 1u << (block & 31));
    }
}

// A warp takes a word of a row: 32 key tiles of (table line, query tile).
__device__ void classify(const TablesParams& p) {
    const int item = warp_row(p.tiles_q * p.tile_words), line = blockIdx.y, lane = threadIdx.x & 31;
    if (item < 0) return;
    const int tq = item / p.tile_words, word = item % p.tile_words, tk = word * 32 + lane;
    const long long row = (long long)line * p.tiles_q + tq;
    const TileState t = tk < p.tiles_k ? tile_state(p, line, tq, tk) : TileState{false, false, 0ull, 0ull};
    const unsigned visited = __ballot_sync(~0u, t.visited), partial = __ballot_sync(~0u, t.partial);
    if (t.visited) atomicAdd(p.col_count + (long long)line * p.tiles_k + tk, 1);
    if (lane == 0) {
        p.visited[row * p.tile_words + word] = visited;
        p.partial[row * p.tile_words + word] = partial;
        if (visited) atomicAdd(p.row_count + row, __popc(visited));
    }
}

// Exclusive scan of count(0..n) into ptr[0..n], one CTA of SCAN_THREADS: each thread sums a run, a scan of
// the runs' sums gives each run its start.
template <class Count, class T>
__device__ void scan(Count count, T* ptr, int n) {
    __shared__ T sums[SCAN_THREADS];
    const int run = (n + SCAN_THREADS - 1) / SCAN_THREADS, first = threadIdx.x * run, last = min(first + run, n);
    T sum = 0;
#pragma unroll 8
    for (int i = first; i < last; ++i) sum += count(i);
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int offset = 1; offset < SCAN_THREADS; offset <<= 1) {
        const T add = threadIdx.x >= offset ? sums[threadIdx.x - offset] : 0;
        __syncthreads();
        sums[threadIdx.x] += add;
        __syncthreads();
    }
    T at = sums[threadIdx.x] - sum;
    for (int i = first; i < last; ++i) {
        ptr[i] = at;
        at += count(i);
    }
    if (threadIdx.x == SCAN_THREADS - 1) ptr[n] = sums[SCAN_THREADS - 1];
}

// The tables' line of batch element b, query head h.
__device__ __forceinline__ int line_of(const TablesParams& p, int b, int h) {
    return (p.lines_batch > 1 ? b : 0) * p.lines_heads + (p.lines_heads > 1 ? h : 0);
}

// The layout column of call column c = (b * heads_q + h) * tiles_k + tile_k: its visit count.
__device__ __forceinline__ int call_column_count(const TablesParams& p, int c) {
    const int tk = c % p.tiles_k, h = (c / p.tiles_k) % p.heads_q, b = c / (p.tiles_k * p.heads_q);
    return p.col_count[(long long)line_of(p, b, h) * p.tiles_k + tk];
}

// Item (b, hk, tile_k)'s visits before the column of its group's head j.
__device__ __forceinline__ int visits_before(const TablesParams& p, int b, int hk, int tk, int j) {
    int n = 0;
    for (int i = 0; i < j; ++i) n += p.col_count[(long long)line_of(p, b, hk * p.group + i) * p.tiles_k + tk];
    return n;
}

// Each CTA of the deal (a thread each) walks its items in order: when it reaches each, counting visits.
__device__ void walk_deal(const TablesParams& p, int cta) {
    if (cta >= p.ctas) return;
    const int heads_kv = p.heads_q / p.group;
    int when = 0;
    for (int r = 0; r < p.rounds; ++r) {
        const int item = p.work[r * p.ctas + cta];
        if (item < 0) break;
        const int tk = item % p.tiles_k, hk = (item / p.tiles_k) % heads_kv, b = item / (p.tiles_k * heads_kv);
        p.item_start[item] = when;
        p.item_rank[item] = r * p.ctas + cta;
        when += visits_before(p, b, hk, tk, p.group) + p.item_cost;
    }
}

// A warp takes a word of a row (as `classify`): its entries start past those of the row's earlier words.
__device__ void write_rows(const TablesParams& p) {
    const int item = warp_row(p.tiles_q * p.tile_words), line = blockIdx.y, lane = threadIdx.x & 31;
    if (item < 0) return;
    const int tq = item / p.tile_words, word = item % p.tile_words, tk = word * 32 + lane;
    const long long row = (long long)line * p.tiles_q + tq;
    int before = 0;
    for (int w = lane; w < word; w += 32) before += __popc(p.visited[row * p.tile_words + w]);
    for (int offset = 16; offset > 0; offset >>= 1) before += __shfl_xor_sync(~0u, before, offset);
    const unsigned visited = p.visited[row * p.tile_words + word];
    if (!((visited >> lane) & 1u)) return;
    const int e = p.row_ptr[row] + before + __popc(visited & ((1u << lane) - 1u));
    if (e >= p.capacity) return;
    const bool partial = (p.partial[row * p.tile_words + word] >> lane) & 1u;
    p.entries[e] = make_int2(tk, partial ? e : -1);
    if (partial) {
        const TileState t = tile_state(p, line, tq, tk);
        p.sub_bits[2 * (long long)e] = t.set_bits;
        p.sub_bits[2 * (long long)e + 1] = t.partial_bits;
    }
}

// Its key tile: the warp's row among the CTAs past the first `ctas_before` (those of the rows).
__device__ void write_columns(const TablesParams& p, int ctas_before) {
    const int tk = (blockIdx.x - ctas_before) * WARPS + (threadIdx.x >> 5), line = blockIdx.y;
    const int lane = threadIdx.x & 31;
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
            const bool partial = (p.partial[row * p.tile_words + word] >> bit) & 1u;
            const int place = __popc(column & ((1u << lane) - 1u)), e = at + place;
            int index = -1;  // the tile's row entry, where wanted
            if (partial || p.work) {
                index = p.row_ptr[row] + __popc(visited & ((1u << bit) - 1u));
                for (int w = 0; w < word; ++w) index += __popc(p.visited[row * p.tile_words + w]);
            }
            const bool in = index >= 0 && index < p.capacity;
            if (p.work && in) p.col_pos[index] = e - p.col_ptr[(long long)line * p.tiles_k + tk];
            if (e < p.capacity) p.col_entries[e] = make_int2(tq, partial && in ? index : -1);
        }
        at += __popc(column);
    }
}

// Query tile tq of batch element b, head h: its visits' ranks among the adds into its dQ, ordered as the deal
// reaches them (its CTA's count of visits when it makes each), then by the deal's order of their items. Each
// CTA's visits come in that order, so the first visit not made waits for none (the fused backward cannot
// deadlock), and the adds into a tile happen about when the deal expects them.
__device__ long long visit_key(const TablesParams& p, int b, int h, long long entry) {
    const int tk = p.entries[entry].x, hk = h / p.group;
    const int item = (b * (p.heads_q / p.group) + hk) * p.tiles_k + tk;
    const long long when = p.item_start[item] + visits_before(p, b, hk, tk, h % p.group) + p.col_pos[entry];
    return when << 32 | p.item_rank[item];
}

__device__ void rank_visits(const TablesParams& p) {
    const int tq = warp_row(p.tiles_q), lane = threadIdx.x & 31;
    if (tq < 0) return;
    const int b = blockIdx.y / p.heads_q, h = blockIdx.y % p.heads_q;
    const long long row = (long long)line_of(p, b, h) * p.tiles_q + tq;
    const int begin = p.row_ptr[row], n = min(p.row_ptr[row + 1], p.capacity) - begin;
    for (int mine = 0; mine < n; mine += 32) {
        const long long key = mine + lane < n ? visit_key(p, b, h, begin + mine + lane) : 0;
        int rank = 0;
        for (int theirs = 0; theirs < n; theirs += 32) {
            const long long other = theirs + lane < n ? visit_key(p, b, h, begin + theirs + lane) : 0;
            for (int i = 0; i < 32 && theirs + i < n; ++i) rank += __shfl_sync(~0u, other, i) < key;
        }
        if (mine + lane < n) {
            const long long entry = begin + mine + lane;
            const long long column = ((long long)(b * p.heads_q + h)) * p.tiles_k + p.entries[entry].x;
            p.ranks[p.rank_ptr[column] + p.col_pos[entry]] = rank;
        }
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    csa_dynamic_tables(const __grid_constant__ TablesParams p) {
    switch (p.step) {
        case 0: choose(p); break;
        case 1: classify(p); break;
        case 2: {  // the rows' scan, the columns'; with a deal, the call columns' and the deal's walks
            const int lines = p.lines_batch * p.lines_heads;
            if (blockIdx.x == 0) scan([&](int i) { return p.row_count[i]; }, p.row_ptr, lines * p.tiles_q);
            else if (blockIdx.x == 1) scan([&](int i) { return p.col_count[i]; }, p.col_ptr, lines * p.tiles_k);
            else if (blockIdx.x == 2)
                scan([&](int c) { return (long long)call_column_count(p, c); }, p.rank_ptr,
                     p.batch * p.heads_q * p.tiles_k);
            else walk_deal(p, (blockIdx.x - 3) * blockDim.x + threadIdx.x);
            break;
        }
        case 3: {  // the rows' CTAs, then the columns'
            const int row_ctas = (p.tiles_q * p.tile_words + WARPS - 1) / WARPS;
            if ((int)blockIdx.x < row_ctas) write_rows(p);
            else write_columns(p, row_ctas);
            break;
        }
        default: rank_visits(p);
    }
}
