#!/usr/bin/env bash
# The machine code of every CUDA kernel variant, without a GPU: compiles each variant that the
# op test `every_kernel_variant_compiles_for_sm90` lists with NVRTC for sm_90 (FERRITE_KERNEL_DUMP),
# disassembles it and prints one line per variant: instructions, registers, stack bytes (spills), and
# the global loads laid out before the dependent-launch wait (SASS ACQBULK), which are the loads
# a kernel can issue while its predecessor still runs. NVRTC, nvdisasm and cuobjdump come from
# NVIDIA's PyPI wheels, fetched once into .tools/ (git-ignored).
#
#   scripts/kernel-sass.sh [FAMILY_PREFIX] > now.tsv      # e.g. gemv_q8
#   git stash; scripts/kernel-sass.sh gemv_q8 > before.tsv; git stash pop
#   join -t$'\t' <(sort before.tsv) <(sort now.tsv) | awk -F'\t' '$2 != $6'   # the variants a change moved
#
# Static only: a kernel change still needs a tg128 A/B on a GPU before it lands (docs/perf.md,
# stop 39: a change that left the weight loads in place still cost 48% on SmolLM2).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-}
tools=.tools/cuda
if [ ! -x "$tools/bin/nvdisasm" ] || ! ls "$tools"/lib/libnvrtc.so.* >/dev/null 2>&1; then
    mkdir -p "$tools" .tools/wheels
    python3 -m pip download --quiet --no-deps -d .tools/wheels nvidia-cuda-nvrtc nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump >&2
    for w in .tools/wheels/*.whl; do python3 -m zipfile -e "$w" .tools/unpacked; done
    mkdir -p "$tools/bin" "$tools/lib"
    find .tools/unpacked -path '*/bin/*' \( -name nvdisasm -o -name cuobjdump \) -exec cp {} "$tools/bin/" \;
    find .tools/unpacked -path '*/lib/*' -name 'libnvrtc*.so*' -exec cp {} "$tools/lib/" \;
    chmod +x "$tools/bin/"*
fi
dump=$(mktemp -d)
trap 'rm -rf "$dump"' EXIT
echo "compiling every kernel variant with NVRTC (a few minutes)..." >&2
FERRITE_KERNEL_DUMP=$dump LD_LIBRARY_PATH="$PWD/$tools/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test -p ferrite-cuda --release --test ops every_kernel_variant_compiles_for_sm90 >&2
# One variant's line; run on every core (xargs), sorted by name.
stats() {
    local f=$1 sass usage
    # (The module cache's files carry a header; these are plain ELF.)
    sass=$("$tools/bin/nvdisasm" -c "$f")
    usage=$("$tools/bin/cuobjdump" -res-usage "$f")
    # Every instruction carries its byte offset as a comment (4 hex digits, more past 64 KB).
    local instructions registers spills before
    instructions=$(grep -cE '/\*[0-9a-f]{4,}\*/' <<< "$sass" || true)
    registers=$(grep -oE 'REG:[0-9]+' <<< "$usage" | head -n1 | cut -d: -f2)
    spills=$(grep -oE 'STACK:[0-9]+' <<< "$usage" | head -n1 | cut -d: -f2)
    before=$(awk '/ACQBULK/ { exit } /LDG/ { n++ } END { print n + 0 }' <<< "$sass")
    printf '%s\t%s\t%s\t%s\t%s\n' "$(basename "$f" .cubin)" "$instructions" "${registers:-?}" "${spills:-?}" "$before"
}
export -f stats
export tools
printf 'variant\tinstructions\tregisters\tstack_bytes\tloads_before_wait\n'
shopt -s nullglob
cubins=("$dump"/"$prefix"*.cubin)
[ ${#cubins[@]} -gt 0 ] || { echo "error: no variant of '$prefix' was compiled" >&2; exit 1; }
printf '%s\0' "${cubins[@]}" | xargs -0 -n 1 -P "$(nproc)" bash -c 'stats "$0"' | sort
