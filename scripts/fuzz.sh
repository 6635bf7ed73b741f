#!/usr/bin/env bash
# Fuzz the GGUF parser (fuzz/fuzz_targets/gguf_parse.rs) with cargo-fuzz for a bounded time.
#
#   scripts/fuzz.sh [SECONDS]          (default 60)
#
# Works on stable Rust: RUSTC_BOOTSTRAP=1 lets stable rustc take the -Z sanitizer flags that
# cargo-fuzz passes. Installs cargo-fuzz if it is missing (about a minute on 2 cores).
# The corpus (fuzz/corpus/gguf_parse, git-ignored) is seeded with the GGUF fixtures; crashes
# are saved under fuzz/artifacts/gguf_parse and make this script fail.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
corpus=fuzz/corpus/gguf_parse
mkdir -p "$corpus"
cp fixtures/gguf/gguf_py/*.gguf "$corpus"/
export RUSTC_BOOTSTRAP=1
cd fuzz
# -rss_limit_mb: a hostile header must not make the parser allocate much more than the input.
cargo fuzz run gguf_parse "../$corpus" -- -max_total_time="$seconds" -rss_limit_mb=1024 -max_len=65536
