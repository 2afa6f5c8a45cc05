// The layout blocks of a token rule (patterns.from_mask on the GPU): for every block of every (batch, head),
// whether the rule lets any of its token pairs through and whether it lets all of them through.
//
// One CTA per block. Its threads evaluate the block's pairs (clipped to the sequences) and vote; a thread
// stops early once it has seen both answers. The builder defines CSA_RULE(b, h, q, k) and P0..P7, A0..A3.
#include "rule.cuh"

using RuleInt = long long;  // the type of P0..P7 here (the attention kernels may take int)

struct MaskParams {
    unsigned char* any;  // [batch, heads, blocks_q, blocks_k]
    unsigned char* all;
    long long seq_q, seq_k;
    int block_q, block_k, blocks_q, blocks_k, heads;
    long long rule_p[8];
    const int* rule_a[4];
};

extern "C" __global__ void __launch_bounds__(256) csa_block_mask(const __grid_constant__ MaskParams p) {
    const int kb = blockIdx.x, qb = blockIdx.y, line = blockIdx.z;
    const long long b = line / p.heads, h = line % p.heads;
    const long long q0 = (long long)qb * p.block_q, k0 = (long long)kb * p.block_k;
    const int rows = (int)min((long long)p.block_q, p.seq_q - q0);
    const int cols = (int)min((long long)p.block_k, p.seq_k - k0);
    (void)b, (void)h;  // a rule need not use them
    bool any = false, all = true;
    for (int i = threadIdx.x; i < rows * cols && (all || !any); i += blockDim.x) {
        const long long q = q0 + i / cols, k = k0 + i % cols;
        const bool visible = CSA_RULE(b, h, q, k);
        any |= visible;
        all &= visible;
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0) {
        const long long at = ((long long)line * p.blocks_q + qb) * p.blocks_k + kb;
        p.any[at] = any;
        p.all[at] = all;
    }
}
