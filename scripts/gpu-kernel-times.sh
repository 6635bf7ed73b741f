#!/usr/bin/env bash
# Per-kernel time and DRAM traffic of a ferrite command under Nsight Compute (`ncu`, on the GPU
# machine), summed by kernel name and grid (one row per launch shape): where a step's time goes,
# kernel by kernel. ncu runs each
# kernel alone (no overlap between launches, no graph replay speed), so these numbers orient
# work; they are never optimisation targets (measure those with `ferrite bench`).
#
#   scripts/gpu-kernel-times.sh [--range] SKIP COUNT -- COMMAND...
#
# SKIP kernels are passed over first (the load's weight expansion, the warm-up), then COUNT are
# profiled. Example, 8 decode steps of the 1B shape after a warm-up:
#   scripts/gpu-kernel-times.sh 200 100 -- .device/ferrite bench --model /tmp/m1.gguf --backend cuda -p 0 -n 8 -r 1
# With --range only the kernels inside the command's profiler range count (`ferrite bench
# --profile-range`: the timed part of each test's last repetition), e.g. 4 batched steps of 64
# sequences (divide the calls and totals by 4 for one step):
#   scripts/gpu-kernel-times.sh --range 0 100000 -- .device/ferrite bench --model /tmp/l8b.gguf --backend cuda -p 0 -n 4 -r 1 --seqs 64 --profile-range
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
range=()
if [ "${1:-}" = "--range" ]; then
    range=(--profile-from-start off)
    shift
fi
[ $# -ge 4 ] && [ "$3" = "--" ] || { echo "usage: $0 [--range] SKIP COUNT -- COMMAND..." >&2; exit 2; }
skip=$1 count=$2
shift 3
csv=$(mktemp)
ncu "${range[@]}" --clock-control none --cache-control none --csv --print-units base --launch-skip "$skip" --launch-count "$count" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum "$@" > "$csv" 2>/dev/null || true
python3 - "$csv" <<'PY'
import csv, sys, collections
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
stats = collections.defaultdict(lambda: [0, 0.0, 0.0])  # calls, ns, bytes
seen = set()
for r in csv.DictReader(rows):
    name = r["Kernel Name"].split("(")[0] + " " + r.get("Grid Size", "").replace(" ", "")
    key = (r["ID"], name)
    s = stats[name]
    if key not in seen:
        seen.add(key)
        s[0] += 1
    v = float(r["Metric Value"].replace(",", ""))
    if r["Metric Name"] == "gpu__time_duration.sum":
        s[1] += v
    else:
        s[2] += v
total = sum(s[1] for s in stats.values()) or 1
print(f"{'kernel grid':<52} {'calls':>6} {'total us':>10} {'us/call':>9} {'MB/call':>9} {'GB/s':>7} {'share':>6}")
for name, (n, ns, b) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:52]:<52} {n:>6} {ns/1e3:>10.1f} {ns/1e3/n:>9.2f} {b/1e6/n:>9.2f} {b/ns if ns else 0:>7.0f} {100*ns/total:>5.1f}%")
print(f"{'all':<52} {sum(s[0] for s in stats.values()):>6} {total/1e3:>10.1f}")
PY
rm -f "$csv"
