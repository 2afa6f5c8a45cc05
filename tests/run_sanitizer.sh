#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the small forward and backward cases (needs a GPU and compute-sanitizer).
# Fails when either tool reports an error. Usage: bash tests/run_sanitizer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
# On an H100/H200 the cases run twice: through the Hopper kernels, then the portable ones.
paths=1
if python3 -c "from cusparseattn import cuda; raise SystemExit(cuda.compute_capability(0) != 90)"; then paths="1 0"; fi
for hopper in $paths; do
    for tool in memcheck racecheck; do
        echo "::: CUSPARSEATTN_HOPPER=$hopper compute-sanitizer --tool $tool"
        # Only our kernels: PyTorch's own launches are not what this checks.
        CUSPARSEATTN_HOPPER=$hopper compute-sanitizer --tool "$tool" --error-exitcode 1 --kernel-name kns=csa_ \
            python3 tests/sanitize_cases.py
    done
done
echo "::: sanitizer clean"
