// The tile tables of a dynamic layout, built on the GPU at every call from the caller's index arrays: what
// the attention passes read of a layout (params.cuh: row_ptr, entries, col_ptr, col_entries, sub_bits), for
// the selection (chosen & within) | plus of cusparseattn.dynamic, with chosen per query block.
//
// One kernel, launched once per step on the call's stream (TablesParams.step), each step reading what the
// last wrote; nothing is read back on the host. Most steps give each warp a row (or a column). The tables
// come out as the host's plan (cusparseattn.plan) would make them for the same selection: rows in key-tile
// order, columns in query-tile order, a partial tile's index its place among the row entries. Integer
// atomics only count and set bits, so the tables are the same bits at every run.
//   0. chosen: per (selection line, query block) a bitmap of the key blocks its valid entries name (an
//      entry that is negative, past the key blocks or past the row's count is ignored; a repeat sets the
//      same bit); and the column counts and bitmaps zeroed.
//   1. tiles: per (table line, query tile), for every key tile, whether any of its cells is set (visited)
//      and whether it is partial, as bitmaps (a warp a row, a word at a time), and by column; counted.
//   2. scan: row_ptr and col_ptr from the counts (a CTA each); for the fused backward, rank_ptr and its deal
//      of items to CTAs by their real visits.
//   3. rows and columns: per row, its entries in key-tile order and a partial tile's sub_bits; per (table
//      line, key tile), its query tiles in order, written to col_entries; for the fused backward, when its
//      deal reaches each item.
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
    unsigned* visited_t;          // [lines, tiles_k, q_words]: visited, by column (a bit per query tile)
    int* row_count;               // [lines * tiles_q]
    int* col_count;               // [lines * tiles_k]
    int* row_ptr;                 // [lines * tiles_q + 1]
    int* col_ptr;                 // [lines * tiles_k + 1]
    int2* entries;                // (key tile, partial index or -1), at most `capacity`
    int2* col_entries;            // (query tile, partial index or -1)
    unsigned long long* sub_bits; // [capacity, 2]: set cells, partial cells
    // The fused backward's schedule (params.cuh: col_start, rank_ptr, ranks), made where `work` is given: its
    // deal of items (b * heads_kv + hk) * tiles_k + tile_k to `ctas` CTAs, `rounds` a CTA, -1 past the last,
    // made from the `items` of `order` (the plan's order of the deal, by expected visits).
    int* work;
    const int* order;
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
    int tiles_q, tiles_k, tile_words, q_words, tile_n, seq_k, capacity;
    int batch, heads_q, group, ctas, rounds, item_cost, items;
    int step;
};

constexpr int THREADS = 256, WARPS = THREADS / 32;  // the CTAs of the steps that give each warp a row
constexpr int SCAN_THREADS = 1024;
enum { NONE = 0, FULL = 1, PARTIAL = 2 };

// What a table line (batch element b, head h) reads: its selection's bitmaps, its static parts' blocks.
struct LineView {
    const unsigned* chosen;       // [n_qb, words]
    const unsigned char* within;  // [n_qb, n_kb], or null: all full
    const unsigned char* plus;    // [n_qb, n_kb], or null: none
};

__device__ __forceinline__ LineView line_view(const TablesParams& p, int line) {
    const int b = line / p.lines_heads, h = line % p.lines_heads;
    const long long blocks = (long long)p.n_qb * p.n_kb;
    const int sel = (p.sel_batch > 1 ? b : 0) * p.sel_heads + (p.sel_heads > 1 ? h / p.sel_group : 0);
    LineView v{p.chosen + (long long)sel * p.n_qb * p.words, nullptr, nullptr};
    if (p.within) v.within = p.within + ((p.w_batch > 1 ? b : 0) * p.w_heads + (p.w_heads > 1 ? h : 0)) * blocks;
    if (p.plus) v.plus = p.plus + ((p.p_batch > 1 ? b : 0) * p.p_heads + (p.p_heads > 1 ? h : 0)) * blocks;
    return v;
}

// The state of cell (rr, cc) of a table line: none, full or partial, from its layout block's.
__device__ __forceinline__ int cell_state(const TablesParams& p, const LineView& v, int rr, int cc) {
    // Blocks and cells are powers of two, a block a whole number of cells.
    const int i = rr >> (__ffs(p.block_q) - __ffs(p.cell_q)), j = cc >> (__ffs(p.block_k) - __ffs(p.cell_k));
    const bool chosen = (v.chosen[i * p.words + (j >> 5)] >> (j & 31)) & 1u;
    if (!chosen && !v.plus) return NONE;  // most cells: the selection is sparse
    const long long at = (long long)i * p.n_kb + j;
    const int w = v.within ? v.within[at] : FULL;
    const int x = v.plus ? v.plus[at] : NONE;
    if ((chosen && w == FULL) || x == FULL) return FULL;
    return (chosen && w != NONE) || x != NONE ? PARTIAL : NONE;
}

struct TileState {
    bool visited, partial;
    unsigned long long set_bits, partial_bits;  // row-major over the tile's cells
};

// Tile (tq, tk) of a table line: visited when a cell is set, full when every cell is (rows past the
// queries' end count as full: nothing is written for them) and the tile ends before the keys do.
__device__ TileState tile_state(const TablesParams& p, const LineView& v, int tq, int tk) {
    TileState t{false, false, 0ull, 0ull};
    bool all_full = (tk + 1) * (long long)p.tile_n <= p.seq_k;
    for (int a = 0; a < p.per_q; ++a) {
        const int rr = tq * p.per_q + a;
        for (int c = 0; c < p.per_k; ++c) {
            const int cc = tk * p.per_k + c;
            if (rr >= p.cell_rows) continue;
            const int s = cc < p.cell_cols ? cell_state(p, v, rr, cc) : NONE;
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
    for (long long w = flat; w < lines * p.tiles_k * p.q_words; w += threads) p.visited_t[w] = 0u;
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

// The grid's warps, each taking items w, w + warps, ... of a step: its rows, then its other items.
__device__ __forceinline__ int grid_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int grid_warps() { return gridDim.x * blockDim.x >> 5; }

// A warp takes a row (table line, query tile), a word of its key tiles at a time.
__device__ void classify(const TablesParams& p, int line, int tq) {
    const int lane = threadIdx.x & 31;
    const LineView v = line_view(p, line);
    const long long row = (long long)line * p.tiles_q + tq;
    int count = 0;
    for (int word = 0; word < p.tile_words; ++word) {
        const int tk = word * 32 + lane;
        const TileState t = tk < p.tiles_k ? tile_state(p, v, tq, tk) : TileState{false, false, 0ull, 0ull};
        const unsigned visited = __ballot_sync(~0u, t.visited), partial = __ballot_sync(~0u, t.partial);
        if (t.visited) {
            const long long column = (long long)line * p.tiles_k + tk;
            atomicAdd(p.col_count + column, 1);
            atomicOr(p.visited_t + column * p.q_words + (tq >> 5), 1u << (tq & 31));
        }
        if (lane == 0) {
            p.visited[row * p.tile_words + word] = visited;
            p.partial[row * p.tile_words + word] = partial;
        }
        count += __popc(visited);
    }
    if (lane == 0) p.row_count[row] = count;
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

// Item `item`'s cost to its CTA: its visits (those of its group's heads) and item_cost.
__device__ __forceinline__ int item_cost(const TablesParams& p, int item) {
    const int heads_kv = p.heads_q / p.group;
    const int tk = item % p.tiles_k, hk = (item / p.tiles_k) % heads_kv, b = item / (p.tiles_k * heads_kv);
    return visits_before(p, b, hk, tk, p.group) + p.item_cost;
}

// The deal (one CTA): the items in `order`, by rounds of `ctas`; in each round the costliest item goes to the
// least loaded CTA, the next to the next (ties: the earlier item, the lower CTA). Every CTA takes one item a
// round, so each CTA's list is its rounds' items, -1 past the last. Its threads in three parts (ctas <=
// DEAL_CTAS): two a round's item rank it by cost, two a CTA rank it by load, and one an item fetches the next
// round's.
constexpr int DEAL_CTAS = 192, RANKERS = 2 * DEAL_CTAS;
static_assert(2 * RANKERS + DEAL_CTAS <= SCAN_THREADS, "the deal's three parts fit its CTA");

// Rank of keys[index] among the unique keys[0..n) (`descending`: the largest first), counted by a pair of
// lanes, each half of the keys.
template <bool descending>
__device__ __forceinline__ int pair_rank(const long long* keys, int n, int index, int half) {
    int rank = 0;
    if (index < n) {
        const long long mine = keys[index];
#pragma unroll 4
        for (int j = half; j < n; j += 2) rank += descending ? keys[j] > mine : keys[j] < mine;
    }
    return rank + __shfl_xor_sync(~0u, rank, 1);
}

__device__ void deal_items(const TablesParams& p) {
    __shared__ int load[DEAL_CTAS], cost[DEAL_CTAS], item_of[DEAL_CTAS], by_rank[DEAL_CTAS], place[DEAL_CTAS];
    // Unique keys: an item's cost, then the earlier item first; a CTA's load, then the lower CTA first.
    __shared__ long long item_key[DEAL_CTAS], load_key[DEAL_CTAS];
    const int t = threadIdx.x, part = t / RANKERS, index = (t % RANKERS) >> 1, half = t & 1;
    const int fetcher = t - 2 * RANKERS;  // part 2's threads
    int next_item = -1, next_cost = 0;
    const auto fetch = [&](int r) {
        if (part == 2 && fetcher < p.ctas && r * p.ctas + fetcher < p.items) {
            next_item = p.order[r * p.ctas + fetcher];
            next_cost = item_cost(p, next_item);
        }
    };
    if (t < p.ctas) load[t] = 0, load_key[t] = t;
    fetch(0);
    for (int r = 0; r < p.rounds; ++r) {
        const int n = min(p.ctas, p.items - r * p.ctas);
        __syncthreads();  // the last round's reads made
        if (part == 2 && fetcher < n) {
            item_of[fetcher] = next_item, cost[fetcher] = next_cost;
            item_key[fetcher] = (long long)next_cost << 32 | (0xffffffffu - fetcher);
        }
        __syncthreads();
        if (part == 0) {
            const int rank = pair_rank<true>(item_key, n, index, half);
            if (!half && index < n) by_rank[rank] = index;
        } else if (part == 1) {
            const int rank = pair_rank<false>(load_key, p.ctas, index, half);
            if (!half && index < p.ctas) place[index] = rank;
        } else {
            fetch(r + 1);  // in flight while the others rank
        }
        __syncthreads();
        if (t < p.ctas) {
            int item = -1;
            if (place[t] < n) {
                const int chosen = by_rank[place[t]];
                item = item_of[chosen];
                load[t] += cost[chosen];
                load_key[t] = (long long)load[t] << 32 | t;
            }
            p.work[r * p.ctas + t] = item;
        }
    }
}

// Each CTA of the deal (a warp each, its lanes 32 rounds at a time) walks its items in order: when it
// reaches each, counting visits, is a scan of their costs. A CTA's -1 entries come after its items.
__device__ void walk_deal(const TablesParams& p, int cta) {
    if (cta >= p.ctas) return;
    const int lane = threadIdx.x & 31;
    int when = 0;
    for (int r0 = 0; r0 < p.rounds; r0 += 32) {
        const int r = r0 + lane;
        const int item = r < p.rounds ? p.work[r * p.ctas + cta] : -1;
        const int cost = item >= 0 ? item_cost(p, item) : 0;
        int upto = cost;  // inclusive scan over the lanes
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int add = __shfl_up_sync(~0u, upto, offset);
            if (lane >= offset) upto += add;
        }
        if (item >= 0) {
            p.item_start[item] = when + upto - cost;
            p.item_rank[item] = r * p.ctas + cta;
        }
        when += __shfl_sync(~0u, upto, 31);
    }
}

// A warp takes a row (as `classify`), a word at a time: a word's entries start past the earlier words'.
__device__ void write_rows(const TablesParams& p, int line, int tq) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)line * p.tiles_q + tq;
    int e0 = p.row_ptr[row];
    for (int word = 0; word < p.tile_words; ++word) {
        const unsigned visited = p.visited[row * p.tile_words + word];
        const int tk = word * 32 + lane, e = e0 + __popc(visited & ((1u << lane) - 1u));
        e0 += __popc(visited);
        if (!((visited >> lane) & 1u) || e >= p.capacity) continue;
        const bool partial = (p.partial[row * p.tile_words + word] >> lane) & 1u;
        p.entries[e] = make_int2(tk, partial ? e : -1);
        if (partial) {
            const TileState t = tile_state(p, line_view(p, line), tq, tk);
            p.sub_bits[2 * (long long)e] = t.set_bits;
            p.sub_bits[2 * (long long)e + 1] = t.partial_bits;
        }
    }
}

// A warp takes a key tile's column. The lanes take words of the column's bitmap of query tiles, each writing
// its word's tiles from its place in the scan of the words' counts.
__device__ void write_columns(const TablesParams& p, int line, int tk) {
    const int lane = threadIdx.x & 31;
    const int word = tk >> 5, bit = tk & 31;
    const long long column = (long long)line * p.tiles_k + tk;
    const int first = p.col_ptr[column];
    int at = first;
    for (int base = 0; base < p.q_words; base += 32) {
        unsigned tiles = base + lane < p.q_words ? p.visited_t[column * p.q_words + base + lane] : 0u;
        const int n = __popc(tiles);
        int upto = n;  // inclusive scan over the lanes
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int add = __shfl_up_sync(~0u, upto, offset);
            if (lane >= offset) upto += add;
        }
        for (int e = at + upto - n; tiles; ++e, tiles &= tiles - 1u) {
            const int tq = (base + lane) * 32 + __ffs(tiles) - 1;
            const long long row = (long long)line * p.tiles_q + tq;
            const bool partial = (p.partial[row * p.tile_words + word] >> bit) & 1u;
            int index = -1;  // the tile's row entry, where wanted
            if (partial || p.work) {
                index = p.row_ptr[row] + __popc(p.visited[row * p.tile_words + word] & ((1u << bit) - 1u));
                for (int w = 0; w < word; ++w) index += __popc(p.visited[row * p.tile_words + w]);
            }
            const bool in = index >= 0 && index < p.capacity;
            if (p.work && in) p.col_pos[index] = e - first;
            if (e < p.capacity) p.col_entries[e] = make_int2(tq, partial && in ? index : -1);
        }
        at += __shfl_sync(~0u, upto, 31);
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
        case 1: {
            const int rows = p.lines_batch * p.lines_heads * p.tiles_q;
            for (int w = grid_warp(); w < rows; w += grid_warps()) classify(p, w / p.tiles_q, w % p.tiles_q);
            break;
        }
        case 2: {  // the rows' scan, the columns'; with a deal, the call columns' and the deal
            const int lines = p.lines_batch * p.lines_heads;
            if (blockIdx.x == 0) scan([&](int i) { return p.row_count[i]; }, p.row_ptr, lines * p.tiles_q);
            else if (blockIdx.x == 1) scan([&](int i) { return p.col_count[i]; }, p.col_ptr, lines * p.tiles_k);
            else if (blockIdx.x == 2)
                scan([&](int c) { return (long long)call_column_count(p, c); }, p.rank_ptr,
                     p.batch * p.heads_q * p.tiles_k);
            else deal_items(p);
            break;
        }
        case 3: {  // the rows, the columns, then the deal's walks
            const int lines = p.lines_batch * p.lines_heads, rows = lines * p.tiles_q;
            const int columns = lines * p.tiles_k, items = rows + columns + (p.work ? p.ctas : 0);
            for (int w = grid_warp(); w < items; w += grid_warps()) {
                if (w < rows) write_rows(p, w / p.tiles_q, w % p.tiles_q);
                else if (w < rows + columns) write_columns(p, (w - rows) / p.tiles_k, (w - rows) % p.tiles_k);
                else walk_deal(p, w - rows - columns);
            }
            break;
        }
        default: rank_visits(p);
    }
}
