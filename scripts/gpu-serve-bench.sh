#!/usr/bin/env bash
# Batched serving on the GPU machine (issue #6's H200 target: aggregate decode at 64 streams
# against the batch-1 rate): writes a synthetic real-shape model with `ferrite synth` unless
# present, starts `ferrite serve --backend cuda` on localhost from the binaries in .device/
# (scripts/gpu-build.sh) and runs scripts/bench_serve.py at each concurrency (Python stdlib only).
#
#   scripts/gpu-serve-bench.sh [SHAPE:DTYPE] [STREAMS]   (default llama-3.1-8b:Q4_0 1,64)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
m=${1:-llama-3.1-8b:Q4_0}
streams=${2:-1,64}
shape=${m%%:*} dtype=${m#*:}
dir=${FERRITE_MODEL_DIR:-/tmp/ferrite-models}
mkdir -p "$dir"
f="$dir/$shape-$dtype.gguf"
[ -f "$f" ] || .device/ferrite synth --shape "$shape" --dtype "$dtype" -o "$f" >/dev/null || exit 1
echo "binaries built from commit $(cat .device/COMMIT 2>/dev/null || echo unknown), model $shape $dtype"
port=18977
.device/ferrite serve --model "$f" --backend cuda --port "$port" --kv-memory 16GiB --max-seqs 64 --max-batch-tokens 512 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null' EXIT
for _ in $(seq 300); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "error: the server exited" >&2; exit 1; }
    sleep 1
done
python3 scripts/bench_serve.py --url "http://127.0.0.1:$port" --streams "$streams" --requests 128 --max-tokens 64
