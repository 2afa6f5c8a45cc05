#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the small forward and backward cases (needs a GPU and compute-sanitizer).
# Fails when either tool reports an error. Usage: bash tests/run_sanitizer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
for tool in memcheck racecheck; do
    echo "::: compute-sanitizer --tool $tool"
    # Only our kernels: PyTorch's own launches are not what this checks.
    compute-sanitizer --tool "$tool" --error-exitcode 1 --kernel-name kns=csa_ python3 tests/sanitize_cases.py
done
echo "::: sanitizer clean"
