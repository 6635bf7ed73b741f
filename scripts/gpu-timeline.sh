#!/usr/bin/env bash
# Where a decode step's time goes with graph replay and dependent launch on: `ferrite bench` with
# FERRITE_CUDA_TIMELINE=1 (see docs/kernels.md, "The kernel timeline") on synthetic real-shape
# models written by `ferrite synth`, from the binaries in .device/ (scripts/gpu-build.sh), on the
# GPU machine. Prints, per model, the plain tg rate, then the timeline table (orientation only: the
# recording costs one atomic per launch, so compare its total with the plain run).
#
#   scripts/gpu-timeline.sh [SHAPE:DTYPE ...]   (default: the SmolLM2, 1B and 8B Q4_0 shapes)
#   BENCH_ARGS="-p 0 -n 64 -r 1 --seqs 64" scripts/gpu-timeline.sh llama-3.1-8b:Q4_0
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m:Q4_1 llama-3.2-1b:Q4_0 llama-3.1-8b:Q4_0)
read -ra bench_args <<< "${BENCH_ARGS:--p 0 -n 128 -r 3}"
dir=${FERRITE_MODEL_DIR:-/tmp/ferrite-models}
mkdir -p "$dir"
status=0
for m in "${models[@]}"; do
    shape=${m%%:*} dtype=${m#*:}
    f="$dir/$shape-$dtype.gguf"
    [ -f "$f" ] || .device/ferrite synth --shape "$shape" --dtype "$dtype" -o "$f" >/dev/null || { status=1; continue; }
    echo "== $shape $dtype: ferrite bench --backend cuda ${bench_args[*]} (plain, then with the timeline)"
    .device/ferrite bench --model "$f" --backend cuda "${bench_args[@]}" 2>&1 | grep -E '^\| (synthetic|pp|tg|x)|ceilings|error' || status=1
    FERRITE_CUDA_TIMELINE=1 .device/ferrite bench --model "$f" --backend cuda "${bench_args[@]}" 2>&1 \
        | sed -n -e '/^error/p' -e '/^kernel timeline/,$p' || status=1
done
exit $status
