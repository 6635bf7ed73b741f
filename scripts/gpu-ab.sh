#!/usr/bin/env bash
# A/B benchmark of two ferrite binaries on the GPU machine, alternated so that drift in clocks
# or temperature falls on both: for each SHAPE:DTYPE (synthetic, written by `ferrite synth` unless
# present), runs BASE, NEW, BASE, NEW with the same `ferrite bench --backend cuda` arguments.
#
#   scripts/gpu-ab.sh BASE NEW [SHAPE:DTYPE ...]
#   BENCH_ARGS="-p 0 -n 128 -r 3" scripts/gpu-ab.sh .device/ferrite-base .device/ferrite llama-3.1-8b:Q4_0
#   BASE_ENV="FERRITE_DISABLE_CUDA_EARLY_RELEASE=1" scripts/gpu-ab.sh .device/ferrite .device/ferrite
#
# BASE_ENV / NEW_ENV (space-separated NAME=VALUE) are set for the BASE / NEW runs only: a switch's
# A/B with one binary.
#
# A binary named *.gz (`gzip -k`: ~4 of its ~11 MB, so that two or three fit in one call's 64 MiB
# carry beside the test executables) is unpacked into a temporary file first.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
[ $# -ge 2 ] || { echo "usage: scripts/gpu-ab.sh BASE NEW [SHAPE:DTYPE ...]" >&2; exit 2; }
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
# The runnable path of a binary argument (a .gz unpacked once).
runnable() {
    case "$1" in
        *.gz) local out
              out="$unpacked/$(echo "$1" | tr '/' '_' | sed 's/\.gz$//')"
              gunzip -c "$1" > "$out" && chmod +x "$out" && echo "$out" ;;
        *) echo "$1" ;;
    esac
}
base=$(runnable "$1") new=$(runnable "$2")
[ -x "$base" ] && [ -x "$new" ] || { echo "error: $1 or $2 is not a runnable binary" >&2; exit 2; }
shift 2
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m:Q4_1 llama-3.2-1b:Q4_0 llama-3.1-8b:Q4_0)
read -ra bench_args <<< "${BENCH_ARGS:--p 0 -n 128 -r 3}"
dir=${FERRITE_MODEL_DIR:-/tmp/ferrite-models}
mkdir -p "$dir"
status=0
for m in "${models[@]}"; do
    shape=${m%%:*} dtype=${m#*:}
    f="$dir/$shape-$dtype.gguf"
    [ -f "$f" ] || "$new" synth --shape "$shape" --dtype "$dtype" -o "$f" >/dev/null || { status=1; continue; }
    for round in 1 2; do
        for side in base new; do
            if [ $side = base ]; then bin=$base; read -ra vars <<< "${BASE_ENV:-}"; else bin=$new; read -ra vars <<< "${NEW_ENV:-}"; fi
            echo "== $shape $dtype round $round: ${vars[*]} $bin bench ${bench_args[*]}"
            env "${vars[@]}" "$bin" bench --model "$f" --backend cuda "${bench_args[@]}" 2>&1 | grep -E '^\| (synthetic|pp|tg)|error' || status=1
        done
    done
done
exit $status
