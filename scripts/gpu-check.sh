#!/usr/bin/env bash
# Run ferrite's GPU test suite on a CUDA machine, from the prebuilt binaries in .device/
# (made by scripts/gpu-build.sh on the build machine), and print a per-op error summary.
#
#   scripts/gpu-check.sh [--bench]  # from the repo root, on the GPU machine
#
# --bench also runs .device/kernel_bench (rough per-launch timings; nothing asserted).
#
# libcuda comes from the driver; libnvrtc and libcublas are looked up in the CUDA toolkit
# (/usr/local/cuda*) and in pip's nvidia-* wheels, and added to LD_LIBRARY_PATH.
# Exit status: 0 only if every test passed and none was skipped for lack of a device.
set -uo pipefail
cd "$(dirname "$0")/.."

shopt -s nullglob
bins=(.device/ferrite_cuda-* .device/ops-*)
[ ${#bins[@]} -gt 0 ] || { echo "error: no test binaries in .device/; run scripts/gpu-build.sh first" >&2; exit 2; }

source scripts/gpu-env.sh
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

log=$(mktemp)
status=0
for b in "${bins[@]}"; do
    echo "== $b"
    "$b" --nocapture --test-threads="${TEST_THREADS:-4}" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo
echo "== per-op errors (max abs, max rel, worst error / tolerance; <= 1 passes)"
printf '| %-10s | %-44s | %9s | %9s | %6s |\n' op case "abs err" "rel err" ratio
grep -E '^\| ' "$log" | sort -t'|' -k2,2 -s
echo
echo "== summary"
grep -E '^test result:|^device:' "$log"
if grep -q '^skipped: ' "$log"; then
    echo "FAIL: tests were skipped on this machine:"
    grep '^skipped: ' "$log" | sort | uniq -c
    status=1
fi
grep -E '^test .* FAILED$|panicked at' "$log" && status=1
[ $status -eq 0 ] && echo "GPU suite: all passed" || echo "GPU suite: FAILED"
rm -f "$log"
if [ "${1:-}" = "--bench" ]; then
    echo
    echo "== kernel_bench"
    .device/kernel_bench || status=1
fi
exit $status
