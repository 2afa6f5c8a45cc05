// MoBA's gate (cusparseattn.selectors.moba) on the GPU: each row's (a query block's, or a query token's) top-k
// key blocks by the dot product of its query (the block's mean query) with each key block's mean key, written
// ascending with -1 padding, the row's own block always in and later ones out when causal. Memory-bounded: the
// pooled keys [B, Hkv, nK, D] and, per query block, the pooled queries are the only scratch; a row's scores
// live in shared memory.
//
// One kernel, launched once per step on the caller's stream (SelectParams.step):
//   0. pool k: the mean of each key block (the last one's over the keys it has), float32;
//   1. pool q: the same for query blocks (per query block only);
//   2. select: a warp a row; its scores against every candidate block to shared memory, then k rounds of a
//      warp argmax (ties to the smaller block, as a stable descending sort), then the chosen blocks written in
//      ascending order by a ballot over the candidates.
// A score that is NaN never wins (as -inf does not), so the result is defined for every input.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The builder defines CSA_SELECT_T (the inputs' element type) and VEC (elements a thread loads at once while
// pooling: 16 bytes' worth where the rows are aligned to it, else 1).
using Element = CSA_SELECT_T;

struct SelectParams {
    const Element* q;  // [batch, heads_q, seq_q, head_dim], strides in elements (q_sd: the head dim's)
    const Element* k;  // [batch, heads_kv, seq_k, head_dim]
    long long q_sb, q_sh, q_ss, q_sd;
    long long k_sb, k_sh, k_ss, k_sd;
    float* k_pool;  // [batch, heads_kv, n_k, head_dim]
    float* q_pool;  // [batch, heads_q, rows, head_dim], or null (per query token: rows read q itself)
    int* out;       // [batch, heads_q, rows, width]
    int batch, heads_q, heads_kv, seq_q, seq_k, head_dim, block, rows, n_k, topk, width, causal, step;
};

constexpr int POOL_THREADS = 256, SELECT_WARPS = 4, MAX_PER_LANE = 8;  // head_dim <= 32 * MAX_PER_LANE
constexpr int NO_BLOCK = 0x7fffffff;
__device__ __forceinline__ float minus_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

__device__ __forceinline__ float as_float(Element x) { return static_cast<float>(x); }

// The mean of block blockIdx.x of head blockIdx.y of batch blockIdx.z of x, to pool: threads split the head dim
// in runs of VEC and the block's tokens in slices, then sum the slices' partial sums in a fixed order.
__device__ void pool(const Element* x, long long sb, long long sh, long long ss, long long sd, int seq,
                     int heads, int blocks, float* pooled, int head_dim, int block) {
    __shared__ float partial[POOL_THREADS * VEC];
    const int runs = (head_dim + VEC - 1) / VEC, slices = POOL_THREADS / runs;
    const int run = threadIdx.x % runs, slice = threadIdx.x / runs;
    const int first = blockIdx.x * block, tokens = min(block, seq - first);
    const Element* base = x + blockIdx.z * sb + blockIdx.y * sh + (long long)first * ss + (long long)run * VEC * sd;
    float sum[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[e] = 0.f;
    if (slice < slices) {
        for (int t = slice; t < tokens; t += slices) {
            const Element* at = base + (long long)t * ss;
            if constexpr (VEC > 1) {
                const uint4 raw = *reinterpret_cast<const uint4*>(at);
                const Element* v = reinterpret_cast<const Element*>(&raw);
#pragma unroll
                for (int e = 0; e < VEC; ++e) sum[e] += as_float(v[e]);
            } else {
                sum[0] += as_float(*at);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) partial[threadIdx.x * VEC + e] = sum[e];
    __syncthreads();
    float* out = pooled + (((long long)blockIdx.z * heads + blockIdx.y) * blocks + blockIdx.x) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += POOL_THREADS) {
        const int r = d / VEC, e = d % VEC;
        float total = 0.f;
        for (int s = 0; s < slices; ++s) total += partial[(s * runs + r) * VEC + e];
        out[d] = total / tokens;
    }
}

// The key block holding row `row`'s last query, aligned bottom-right; negative where it has no key.
__device__ __forceinline__ int own_block(const SelectParams& p, int row) {
    const int last = p.q_pool ? min((row + 1) * p.block, p.seq_q) - 1 : row;
    const int aligned = last + (p.seq_k - p.seq_q);
    return aligned >= 0 ? aligned / p.block : -1;
}

// The scores of key blocks j..j+N-1 (their pooled keys at `keys`) to `scores`, NaN as -inf: the warp's
// lanes split the head dim, and the N sums reduce together.
template <int N>
__device__ __forceinline__ void score_blocks(const float* query, const float* keys, int j, int head_dim,
                                             int lane, float* scores) {
    float dot[N];
#pragma unroll
    for (int u = 0; u < N; ++u) dot[u] = 0.f;
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        if (d < head_dim) {
#pragma unroll
            for (int u = 0; u < N; ++u) dot[u] += query[e] * keys[(long long)(j + u) * head_dim + d];
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
        for (int u = 0; u < N; ++u) dot[u] += __shfl_xor_sync(~0u, dot[u], offset);
    }
#pragma unroll
    for (int u = 0; u < N; ++u) {
        if (lane == u) scores[j + u] = is_nan(dot[u]) ? minus_infinity() : dot[u];
    }
}

__device__ void select(const SelectParams& p) {
    extern __shared__ float shared_scores[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row_id = (long long)blockIdx.x * SELECT_WARPS + warp;
    if (row_id >= (long long)p.batch * p.heads_q * p.rows) return;
    float* scores = shared_scores + warp * p.n_k;
    const int row = (int)(row_id % p.rows), h = (int)(row_id / p.rows % p.heads_q);
    const int b = (int)(row_id / ((long long)p.rows * p.heads_q));
    const int hk = h / (p.heads_q / p.heads_kv);

    float query[MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        float x = 0.f;
        if (d < p.head_dim) {
            x = p.q_pool ? p.q_pool[row_id * p.head_dim + d]
                         : as_float(p.q[b * p.q_sb + h * p.q_sh + (long long)row * p.q_ss + d * p.q_sd]);
        }
        query[e] = x;
    }
    const int own = p.causal ? own_block(p, row) : -1;
    const int candidates = p.causal ? max(own, 0) : p.n_k;
    const float* keys = p.k_pool + ((long long)b * p.heads_kv + hk) * p.n_k * p.head_dim;
    int j = 0;
    for (; j + 4 <= candidates; j += 4) score_blocks<4>(query, keys, j, p.head_dim, lane, scores);
    for (; j < candidates; ++j) score_blocks<1>(query, keys, j, p.head_dim, lane, scores);
    __syncwarp();

    // A chosen block's score becomes NaN: never chosen again, and told apart from the rest below.
    for (int round = 0; round < p.topk; ++round) {
        float best = minus_infinity();
        int best_j = NO_BLOCK;
        for (int j = lane; j < candidates; j += 32) {
            const float s = scores[j];
            if (s > best) best = s, best_j = j;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(~0u, best, offset);
            const int other_j = __shfl_xor_sync(~0u, best_j, offset);
            if (other > best || (other == best && other_j < best_j)) best = other, best_j = other_j;
        }
        if (best_j == NO_BLOCK) break;
        __syncwarp();  // every lane's reads of this round before the write
        if (lane == 0) scores[best_j] = __int_as_float(0x7fffffff);
        __syncwarp();
    }

    int* out = p.out + row_id * p.width;
    int count = 0;
    for (int base = 0; base < candidates; base += 32) {
        const int c = base + lane;
        const bool chosen = c < candidates && is_nan(scores[c]);
        const unsigned ballot = __ballot_sync(~0u, chosen);
        if (chosen) out[count + __popc(ballot & ((1u << lane) - 1u))] = c;
        count += __popc(ballot);
    }
    if (own >= 0) {
        if (lane == 0) out[count] = own;
        ++count;
    }
    for (int i = count + lane; i < p.width; i += 32) out[i] = -1;
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS) csa_moba_select(const SelectParams p) {
    if (p.step == 0) {
        pool(p.k, p.k_sb, p.k_sh, p.k_ss, p.k_sd, p.seq_k, p.heads_kv, p.n_k, p.k_pool, p.head_dim, p.block);
    } else if (p.step == 1) {
        pool(p.q, p.q_sb, p.q_sh, p.q_ss, p.q_sd, p.seq_q, p.heads_q, p.rows, p.q_pool, p.head_dim, p.block);
    } else {
        select(p);
    }
}
