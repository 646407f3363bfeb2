"""Per-layer times of the default model's linear layers: GGUF blocks (fast and exact modes,
straight from the blocks; dequantize + GEMM) against dense bf16 / fp32 weights.

    python benchmarks/quant_linear.py [--rows 1,2,4,8,16,32,64,512]

For each row count M it sums one decode step's worth of layers (every layer's qkv, o_proj,
gate_up and down, and the output projection) and prints milliseconds per step with each
kernel, and the packed bytes over the measured time (GB/s). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from duoserve.config import ModelConfig
import duoserve.kernels.gguf as gguf
from duoserve.kernels.dense import linear_any_m
from duoserve.kernels.linear import GGUFLinear
from duoserve.worker.backends import load_model


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(ModelConfig(dtype="float32", quantization="gguf")).model
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    packed_bytes = sum(p.nbytes for layer in layers for p in layer.parts)
    dense = {dtype: [gguf.dequantize_rows(p, dtype) for layer in layers for p in layer.parts]
             for dtype in (torch.float32, torch.bfloat16)}
    parts = [p for layer in layers for p in layer.parts]
    results = {"packed_MB": packed_bytes / 1e6, "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        row = {}
        x = torch.randn(m, parts[0].cols)
        xs = {p.cols: torch.randn(m, p.cols) for p in parts}
        for mode in ("fast", "exact"):
            row[f"{mode}_blocks_ms"] = timed(lambda: [gguf.gguf_linear(xs[p.cols], p.data, gguf.type_id(p), p.cols, mode)
                                                      for p in parts], args.repeat)
        # what milestone 2 ran for more than 8 rows: the weight dequantized (all of it, in slices
        # of rows before) into float32, then oneDNN's GEMM
        row["dequant_gemm_ms"] = timed(lambda: [linear_any_m(xs[p.cols], gguf.dequantize_rows(p, torch.float32), None)
                                                for p in parts], args.repeat)
        for dtype, weights in dense.items():
            xd = {c: t.to(dtype) for c, t in xs.items()}
            row[f"dense_{str(dtype)[6:]}_ms"] = timed(lambda: [linear_any_m(xd[w.shape[1]], w, None) for w in weights],
                                                      args.repeat)
        row["fast_blocks_GB_s"] = packed_bytes / row["fast_blocks_ms"] / 1e6 if "fast_blocks_ms" in row else None
        results["rows"][m] = row
        print(m, {k: round(v, 2) for k, v in row.items() if v is not None}, flush=True)
    del x
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
