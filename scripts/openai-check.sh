#!/usr/bin/env bash
# `ferrite serve` checked with the official openai Python client: installs `openai` into the
# git-ignored .venv-openai/ (skipped with a note if pip cannot install it), starts the server built
# by `cargo test` (target/debug/ferrite, or the binary given as $1) on a free port with an API key, runs
# scripts/openai_check.py, then stops the server with SIGTERM (graceful drain).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/debug/ferrite}
[ -x "$bin" ] || { echo "error: $bin not built (run cargo test or cargo build first)" >&2; exit 1; }
if [ ! -x .venv-openai/bin/python ] || ! .venv-openai/bin/python -c 'import openai' 2>/dev/null; then
    if ! { python3 -m venv .venv-openai && .venv-openai/bin/pip install --quiet openai; } >/dev/null 2>&1; then
        echo "openai client check: skipped (could not install the openai package with pip)"
        exit 0
    fi
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
FERRITE_THREADS=2 "$bin" serve --port "$port" --api-key check-key --kv-memory 256MiB >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "error: ferrite serve exited" >&2; exit 1; }
    sleep 0.2
done
.venv-openai/bin/python scripts/openai_check.py "http://127.0.0.1:$port/v1" check-key
kill -TERM "$pid"
wait "$pid" || { cat "$log"; echo "error: ferrite serve did not shut down cleanly" >&2; exit 1; }
