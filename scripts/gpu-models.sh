#!/usr/bin/env bash
# Whole-model GPU checks and benchmarks, on the GPU machine, from the binaries in .device/
# (scripts/gpu-build.sh): the CUDA-vs-CPU model test binary, then for synthetic real-shape models
# written there by `ferrite synth`: `ferrite compare` (CPU fp32 reference vs CUDA) and
# `ferrite bench --backend cuda`.
#
#   scripts/gpu-models.sh [SHAPE:DTYPE ...]   (default: smollm2-135m:Q4_1 llama-3.2-1b:Q4_0)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m:Q4_1 llama-3.2-1b:Q4_0)
dir=${FERRITE_MODEL_DIR:-/tmp/ferrite-models}
mkdir -p "$dir"
status=0
for b in .device/cuda_model-*; do
    echo "== $b"
    "$b" --nocapture || status=1
done
for m in "${models[@]}"; do
    shape=${m%%:*} dtype=${m#*:}
    f="$dir/$shape-$dtype.gguf"
    [ -f "$f" ] || .device/ferrite synth --shape "$shape" --dtype "$dtype" -o "$f" || { status=1; continue; }
    echo "== compare $shape $dtype (cpu-ref vs cuda, fp32 KV)"
    FERRITE_CUDA_KV_DTYPE=f32 .device/ferrite compare --model "$f" --backend cuda --ref cpu-ref --steps 64 "Once upon a time" 2>&1 | tail -n 8 || status=1
    echo "== bench $shape $dtype"
    .device/ferrite bench --model "$f" --backend cuda -p 512 -n 128 -r 5 2>&1 | grep -E '^\||error' || status=1
    echo "== A/B: prefill with FERRITE_CUDA_EXPAND_WEIGHTS=off"
    FERRITE_CUDA_EXPAND_WEIGHTS=off .device/ferrite bench --model "$f" --backend cuda -p 512 -n 0 -r 3 2>&1 | grep -E 'pp512|error' || status=1
    # A/B pairs: each switch against the default, decode only, back to back.
    for ab in FERRITE_DISABLE_INT8_HANDOFF=1 FERRITE_DISABLE_KV_STORE_FUSION=1 FERRITE_DISABLE_CUDA_GRAPH=1 FERRITE_DISABLE_CUDA_PDL=1 FERRITE_CUDA_GEMV_ACTIVATIONS=f32 FERRITE_SPLIT_ATTENTION=0; do
        echo "== A/B: decode with $ab"
        env "$ab" .device/ferrite bench --model "$f" --backend cuda -p 0 -n 128 -r 5 2>&1 | grep -E 'tg128|error' || status=1
    done
done
exit $status
