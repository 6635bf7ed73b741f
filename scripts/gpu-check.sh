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

# Folders holding a library, toolkit first (its NVRTC matches the installed nvcc and driver).
lib_dir() {
    local name=$1 roots=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64)
    if command -v python3 >/dev/null; then
        roots+=($(python3 -c 'import site,sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null))
    fi
    for r in "${roots[@]}"; do
        [ -d "$r" ] || continue
        local hit
        hit=$(find -L "$r" -maxdepth 4 -name "$name" 2>/dev/null | head -n1)
        [ -n "$hit" ] && { dirname "$hit"; return; }
    done
}
extra=""
for lib in 'libnvrtc.so.1[0-9]*' 'libcublas.so.1[0-9]*' 'libcublasLt.so.1[0-9]*'; do
    d=$(lib_dir "$lib")
    if [ -n "$d" ]; then
        case ":$extra:" in *":$d:"*) ;; *) extra="$extra:$d" ;; esac
    else
        echo "warning: $lib not found under the CUDA toolkit or pip's nvidia wheels" >&2
    fi
done
[ -d /usr/local/nvidia/lib64 ] && extra="$extra:/usr/local/nvidia/lib64"
export LD_LIBRARY_PATH="${extra#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
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
