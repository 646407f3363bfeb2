"""gguf_linear.c's fast mode at a git revision against the working tree's, call for call.

    python benchmarks/gguf_linear_ab.py [--before HEAD] [--rows 1,4,16,128] [--types all]
        [--shapes 8960x1536,1536x8960,151936x1536,32768x4096]

Both builds with the engine's flags, loaded with ctypes; for each block type and weight shape
[n x k] (default [2048 x 1024]) random blocks (random bytes under finite fp16 scales: the
kernels' work does not depend on the values) and bfloat16 rows of x, 2 threads, the two kernels
called alternately (--calls times each: the machine's drift hits both alike), each on the blocks
as fast mode keeps them in that build (repacked by its ``gguf_interleave`` where it has one and
takes the type: GGUFLinear does so at load). Prints median
milliseconds, their ratio, the weights' bytes read per second (GB/s: at one row a decode step's
rate against the memory's, `floors.py`), the multiply-adds per second (GMAC/s: many rows'), and
the largest relative difference of the outputs (0: the same bits; not 0 where the arithmetic
changed). Also the seconds each build took to compile (a first start waits for it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CSRC = ROOT / "duoserve" / "kernels" / "csrc"


def csrc_at(revision: str | None) -> dict[str, str]:
    """csrc/'s gguf_linear.c and headers at a git revision (None: the working tree's)."""
    if revision is None:
        return {p.name: p.read_text() for p in [*CSRC.glob("*.h"), CSRC / "gguf_linear.c"]}
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:duoserve/kernels/csrc"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{revision}:duoserve/kernels/csrc/{name}"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
            for name in listing if name.endswith(".h") or name == "gguf_linear.c"}


def build(sources: dict[str, str], work: Path, name: str) -> tuple[ctypes.CDLL, float]:
    from duoserve.kernels.build import C_FLAGS

    work.mkdir()
    for file_name, text in sources.items():
        (work / file_name).write_text(text)
    start = time.perf_counter()
    subprocess.run(["gcc", *C_FLAGS, "-shared", str(work / "gguf_linear.c"), "-o", str(work / name), "-lm"], check=True)
    return ctypes.CDLL(str(work / name)), time.perf_counter() - start


def as_loaded(lib: ctypes.CDLL, w: torch.Tensor, type_id: int, n: int, k: int) -> tuple[torch.Tensor, int]:
    """The blocks and type id the build computes from: its interleaved layout where it has one for
    this type and row count (as GGUFLinear repacks at load), else the file's."""
    interleave = getattr(lib, "gguf_interleave", None)
    if interleave is None:
        return w, type_id
    interleave.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    lib.gguf_row_bytes.restype, lib.gguf_row_bytes.argtypes = ctypes.c_int64, (ctypes.c_int, ctypes.c_int)
    row_bytes = lib.gguf_row_bytes(type_id | 16, k)   # interleaved (csrc/gguf_interleaved.h): Q4_K's 148 a block
    if row_bytes < 0:
        return w, type_id
    out = torch.empty(n, row_bytes, dtype=torch.uint8)
    repacked = interleave(w.data_ptr(), type_id, n, k, out.data_ptr(), 2)
    return (out, repacked) if repacked >= 0 else (w, type_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--rows", default="1,2,4,16,128")
    parser.add_argument("--types", default="Q4_K,Q5_0,Q6_K,Q8_0,Q4_1", help="comma-separated, or all")
    parser.add_argument("--shapes", default="2048x1024", help="comma-separated NxK weight shapes")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    from duoserve.kernels.gguf import BLOCK_TYPES
    from tests.model.test_gguf import F16_FIELDS

    def random_blocks(type_name: str, n: int, k: int) -> np.ndarray:
        rng = np.random.default_rng(1)
        values, size = BLOCK_TYPES[type_name].values, BLOCK_TYPES[type_name].bytes
        raw = rng.integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
        for offset in F16_FIELDS[type_name]:
            raw[:, offset:offset + 2] = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16).view(
                np.uint8).reshape(-1, 2)
        return raw.reshape(n, -1)

    types = list(BLOCK_TYPES) if args.types == "all" else args.types.split(",")

    result: dict = {"before": args.before}
    with tempfile.TemporaryDirectory() as tmp:
        before, result["compile_s_before"] = build(csrc_at(args.before), Path(tmp) / "before", "before.so")
        after, result["compile_s_after"] = build(csrc_at(None), Path(tmp) / "after", "after.so")
        for shape, type_name in ((shape, t) for shape in args.shapes.split(",") for t in types):
            n, k = map(int, shape.split("x"))
            w = torch.from_numpy(random_blocks(type_name, n, k))
            loaded = {name: as_loaded(lib, w, BLOCK_TYPES[type_name].id, n, k)
                      for name, lib in (("before", before), ("after", after))}
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).to(torch.bfloat16)
                times: dict[str, list[float]] = {"before": [], "after": []}
                outs = {}
                for _ in range(args.calls):
                    for name, lib in (("before", before), ("after", after)):
                        y = torch.empty(m, n, dtype=torch.bfloat16)
                        start = time.perf_counter()
                        blocks, type_id = loaded[name]
                        status = lib.gguf_linear_fast(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(blocks.data_ptr()),
                                                      type_id, m, n, k, ctypes.c_void_p(y.data_ptr()), 1, 2)
                        assert status == 0
                        times[name].append((time.perf_counter() - start) * 1000)
                        outs[name] = y
                b, a = (statistics.median(times[name]) for name in ("before", "after"))
                diff = ((outs["before"].float() - outs["after"].float()).abs().max()
                        / outs["before"].float().abs().max()).item()
                result[f"{type_name} [{n}x{k}] m={m}"] = {
                    "before_ms": round(b, 3), "after_ms": round(a, 3), "after_over_before": round(a / b, 2),
                    "before_GBps": round(w.numel() / b / 1e6, 1), "after_GBps": round(w.numel() / a / 1e6, 1),
                    "before_GMACps": round(m * n * k / b / 1e6, 1), "after_GMACps": round(m * n * k / a / 1e6, 1),
                    "max_relative_difference": diff}
                print(f"{type_name:5s} [{n}x{k}] m={m:3d}: {b:8.3f} -> {a:8.3f} ms ({a / b:.2f}x), "
                      f"{w.numel() / a / 1e6:6.1f} GB/s, {m * n * k / a / 1e6:6.1f} GMAC/s, diff {diff:.1e}",
                      file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
