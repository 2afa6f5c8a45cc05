#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the small forward and backward cases (needs a GPU and compute-sanitizer).
# Fails when either tool reports an error. Usage: bash tests/run_sanitizer.sh [modes], modes from
# hopper, fused, portable (default: those the GPU runs).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
# On an H100/H200 the cases run through the Hopper kernels (the two backward passes), the fused Hopper backward, then
# the portable ones.
modes="${*:-portable}"
if [ $# -eq 0 ] && python3 -c "from cusparseattn import devices; raise SystemExit(devices.compute_capability(0) != 90)"; then
    modes="hopper fused portable"
fi
for mode in $modes; do
    case $mode in
        hopper) switches="CUSPARSEATTN_HOPPER=1 CUSPARSEATTN_FUSED_BACKWARD=0" ;;
        fused) switches="CUSPARSEATTN_HOPPER=1 CUSPARSEATTN_FUSED_BACKWARD=1" ;;
        portable) switches="CUSPARSEATTN_HOPPER=0" ;;
        *) echo "unknown mode $mode (hopper, fused, portable)"; exit 2 ;;
    esac
    for tool in memcheck racecheck; do
        echo "::: $switches compute-sanitizer --tool $tool"
        # Only our kernels: PyTorch's own launches are not what this checks.
        env $switches compute-sanitizer --tool "$tool" --error-exitcode 1 --kernel-name kns=csa_ \
            python3 tests/sanitize_cases.py
    done
done
echo "::: sanitizer clean"
