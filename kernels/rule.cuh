// What traced rule and score expressions (cusparseattn.trace) call besides C's operators, shared by the
// attention kernels and the block classification of a rule. NVRTC-clean: no host headers.
#pragma once

namespace csa {

// Python's floor division and modulo on integers (C's / and % truncate toward zero).
__device__ __forceinline__ long long floordiv(long long a, long long b) {
    const long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long floormod(long long a, long long b) { return a - floordiv(a, b) * b; }

}  // namespace csa
