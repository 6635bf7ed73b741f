#!/usr/bin/env bash
# The H200 benchmark table of docs/perf.md: for each SHAPE:DTYPE, write the synthetic model with
# `ferrite synth` (real shapes, random weights) unless present, then `ferrite bench --backend cuda
# -p 512 -n 128 -r 5`, which prints tok/s and each test as a fraction of the ceilings it measures
# in the same run. Runs on the GPU machine from the binaries in .device/ (scripts/gpu-build.sh).
#
#   scripts/gpu-bench.sh [SHAPE:DTYPE ...]
#   BENCH_ARGS="-p 0 -n 64 -r 3 --seqs 8,64" scripts/gpu-bench.sh llama-3.1-8b:Q4_0   # other tests
#   TIMELINE=1 BENCH_ARGS="-p 0 -n 128 -r 3" scripts/gpu-bench.sh   # then each again with
#       FERRITE_CUDA_TIMELINE=1: what each kernel adds to a replayed step (docs/kernels.md;
#       orientation only, the recording costs an atomic per launch)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m:Q4_1 llama-3.2-1b:Q4_0 llama-3.2-1b:Q4_K llama-3.1-8b:Q4_0 llama-3.1-8b:Q8_0 llama-3.1-8b:Q4_K
    llama-3.1-8b:Q6_K llama-3.1-8b:F16 qwen3-8b:Q4_0 gemma3-270m:Q8_0 qwen3.5-9b:Q4_0)
read -ra bench_args <<< "${BENCH_ARGS:--p 512 -n 128 -r 5}"
dir=${FERRITE_MODEL_DIR:-/tmp/ferrite-models}
mkdir -p "$dir"
status=0
echo "binaries built from commit $(cat .device/COMMIT 2>/dev/null || echo unknown), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
for m in "${models[@]}"; do
    shape=${m%%:*} dtype=${m#*:}
    f="$dir/$shape-$dtype.gguf"
    [ -f "$f" ] || .device/ferrite synth --shape "$shape" --dtype "$dtype" -o "$f" >/dev/null || { status=1; continue; }
    echo "== $shape $dtype: ferrite bench --backend cuda ${bench_args[*]}"
    .device/ferrite bench --model "$f" --backend cuda "${bench_args[@]}" 2>&1 | grep -E '^\| (synthetic|pp|tg)|ceilings|error' || status=1
    if [ "${TIMELINE:-0}" = 1 ]; then
        FERRITE_CUDA_TIMELINE=1 .device/ferrite bench --model "$f" --backend cuda "${bench_args[@]}" 2>&1 \
            | sed -n -e '/^error/p' -e '/^kernel timeline/,$p' || status=1
    fi
done
exit $status
