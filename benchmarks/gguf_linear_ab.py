"""gguf_linear.c's fast mode at a git revision against the working tree's, call for call.

    python benchmarks/gguf_linear_ab.py [--before HEAD] [--rows 1,2,4,16,128]

Both builds with the engine's flags, loaded with ctypes; for each block type a [n, k] ([2048, 1024])
weight of random blocks and bfloat16 rows of x, 2 threads, the two kernels called alternately
(40 times each: the machine's drift hits both alike). Prints median milliseconds, their ratio,
and the largest relative difference of the outputs (0: the same bits). Also the seconds each
build took to compile (a first start waits for it).
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


def build(source: str, work: Path, name: str) -> tuple[ctypes.CDLL, float]:
    from duoserve.kernels.build import C_FLAGS

    work.mkdir()
    for header in CSRC.glob("*.h"):
        (work / header.name).write_text(header.read_text())
    (work / "gguf_linear.c").write_text(source)
    start = time.perf_counter()
    subprocess.run(["gcc", *C_FLAGS, "-shared", str(work / "gguf_linear.c"), "-o", str(work / name), "-lm"], check=True)
    return ctypes.CDLL(str(work / name)), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--rows", default="1,2,4,16,128")
    parser.add_argument("--types", default="Q4_K,Q5_0,Q6_K,Q8_0,Q4_1")
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=1024)
    args = parser.parse_args()
    from duoserve.kernels.gguf import BLOCK_TYPES
    from tests.kernels.test_gguf import random_blocks

    old = subprocess.run(["git", "show", f"{args.before}:duoserve/kernels/csrc/gguf_linear.c"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    result: dict = {"before": args.before}
    with tempfile.TemporaryDirectory() as tmp:
        before, result["compile_s_before"] = build(old, Path(tmp) / "before", "before.so")
        after, result["compile_s_after"] = build((CSRC / "gguf_linear.c").read_text(), Path(tmp) / "after", "after.so")
        n, k = args.n, args.k
        for type_name in args.types.split(","):
            raw, _ = random_blocks(type_name, n, k, seed=1)
            w = torch.from_numpy(np.ascontiguousarray(raw))
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).to(torch.bfloat16)
                times: dict[str, list[float]] = {"before": [], "after": []}
                outs = {}
                for _ in range(40):
                    for name, lib in (("before", before), ("after", after)):
                        y = torch.empty(m, n, dtype=torch.bfloat16)
                        start = time.perf_counter()
                        status = lib.gguf_linear_fast(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()),
                                                      BLOCK_TYPES[type_name][0], m, n, k, ctypes.c_void_p(y.data_ptr()),
                                                      1, 2)
                        assert status == 0
                        times[name].append((time.perf_counter() - start) * 1000)
                        outs[name] = y
                b, a = (statistics.median(times[name]) for name in ("before", "after"))
                diff = ((outs["before"].float() - outs["after"].float()).abs().max()
                        / outs["before"].float().abs().max()).item()
                result[f"{type_name} m={m}"] = {"before_ms": round(b, 3), "after_ms": round(a, 3),
                                                "after_over_before": round(a / b, 2), "max_relative_difference": diff}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
