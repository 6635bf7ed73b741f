#!/usr/bin/env bash
# Build the GPU test executables, the kernel_bench example (and, unless --tests-only, the ferrite
# CLI) on this machine and copy them, stripped, into .device/ (git-ignored), ready for
# scripts/gpu-check.sh on a GPU machine.
# No CUDA is needed to build: ferrite-cuda loads libcuda/libnvrtc/libcublas at run time.
#
#   scripts/gpu-build.sh [--tests-only]
#
# Then, on the GPU machine (from the repo root, with .device/ carried along): scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device
rm -f .device/ops-* .device/ferrite_cuda-* .device/kernel_bench .device/ferrite

# Cargo prints "Executable <target> (<path>)" for every test binary it builds.
log=$(cargo test -p ferrite-cuda --release --no-run 2>&1) || { echo "$log" >&2; exit 1; }
paths=$(echo "$log" | sed -n 's/.*Executable .* (\(.*\))$/\1/p')
[ -n "$paths" ] || { echo "error: cargo reported no test executables" >&2; echo "$log" >&2; exit 1; }
for p in $paths; do
    cp "$p" .device/
    strip ".device/$(basename "$p")"
done

# The whole-model CUDA-vs-CPU test (scripts/gpu-models.sh runs it).
log=$(cargo test -p ferrite-engine --release --test cuda_model --no-run 2>&1) || { echo "$log" >&2; exit 1; }
p=$(echo "$log" | sed -n 's/.*Executable .* (\(.*cuda_model-[^)]*\))$/\1/p')
rm -f .device/cuda_model-*
cp "$p" .device/ && strip ".device/$(basename "$p")"

cargo build -p ferrite-cuda --release --example kernel_bench
cp target/release/examples/kernel_bench .device/
strip .device/kernel_bench

if [ "${1:-}" != "--tests-only" ]; then
    cargo build -p ferrite-cli --release
    cp target/release/ferrite .device/
    strip .device/ferrite
fi
# The commit the binaries were built from (the device's copy of the tree may not know it).
git describe --always --dirty --abbrev=7 > .device/COMMIT 2>/dev/null || echo unknown > .device/COMMIT
ls -la .device/
du -sh .device/ | awk '{print "total " $1 " (the device carry limit is 64 MiB)"}'
