"""The machine's floors for a quantized decode step: memory read bandwidth and the GGUF kernel's rate.

    python benchmarks/floors.py [--threads 2]

Read bandwidth: the median time of summing a 512 MB float32 tensor with the given threads (a
one-stream decode step reads its weights once: bytes a token / this = the step's floor). Kernel
rate: ``duoserve::gguf_linear`` (fast mode, bf16 activations) on random blocks of three types and
shapes like the served files' (Gemma's Q8_0 head, a Q4_K projection, a Q5_0 one) at 1, 16 and 128
rows, in GMAC/s (a step's multiply-adds / this = its compute floor), on the blocks as fast mode
holds them (GGUFLinear's runs: Q8_0 and Q5_0 interleaved). Prints one line each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests.kernels' random blocks


def median_seconds(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from duoserve.kernels.linear import GGUFLinear
    from duoserve.model.gguf_loader import GGUFBlocks
    from tests.kernels.test_gguf import random_blocks

    for type_name, n, k in (("Q8_0", 4096, 640), ("Q4_K", 2048, 2048), ("Q5_0", 2048, 896)):
        raw, _ = random_blocks(type_name, n, k, seed=1)
        linear = GGUFLinear([GGUFBlocks(torch.from_numpy(np.ascontiguousarray(raw)).reshape(n, -1), type_name, n, k)],
                            None, "fast")
        for m in (1, 16, 128):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            seconds = median_seconds(lambda: linear(x))
            print(f"gguf_linear {type_name} [{n} x {k}], {m:3d} rows: {seconds * 1e3:7.3f} ms, "
                  f"{m * n * k / seconds / 1e9:5.1f} GMAC/s")
    big = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    print(f"read bandwidth: {big.numel() * 4 / median_seconds(big.sum, 7) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
