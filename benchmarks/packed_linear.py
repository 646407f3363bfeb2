"""A decode step's linear layers, kernel against kernel: packed, small-row, oneDNN.

    python benchmarks/packed_linear.py --dtype bfloat16 --rows 1,4,8,32,64,512

The 121 linear layers of one SmolLM2-135M step (per layer: fused q/k/v 960 x 576, output
576 x 576, fused gate/up 3072 x 576, down 576 x 1536; then the 49152 x 576 output
projection), each with its own random weight, so the 538 MB (fp32) or 269 MB (bf16) of a step
come from memory as in a real step. For each row count: the median time of the whole sweep
with ``csrc/packed_linear.c`` over the packed weights, oneDNN's linear over the plain ones
(``mkldnn._linear_pointwise``, what duoserve used before), and the small-row C kernel where it
applies; the kernels alternate so that the machine's drift hits all alike. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,4,8,32,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from duoserve.kernels.dense import c_packed_linear, c_small_m_linear, pack_linear_weight

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = LAYER * 30 + [(49152, 576)]
    plain = [torch.randn(n, k).to(dtype) for n, k in shapes]
    packed = [pack_linear_weight(w) for w in plain]
    if any(p is None for p in packed):
        raise SystemExit(f"the packed kernel does not serve {args.dtype} on this CPU")
    kernels = {
        "packed": lambda x, i: c_packed_linear(x, packed[i], None, shapes[i][0]),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, plain[i], None, "none", [], ""),
        "small_m": lambda x, i: c_small_m_linear(x, plain[i], None),
    }
    result = {"dtype": args.dtype, "threads": args.threads, "weight_mb": round(sum(w.nbytes for w in plain) / 2**20)}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        names = [name for name in kernels if name != "small_m" or rows <= 8]
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                start = time.perf_counter()
                for i, (_, k) in enumerate(shapes):
                    kernels[name](inputs[k], i)
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
        flops = 2 * rows * sum(n * k for n, k in shapes)
        result[f"{rows} rows"] = {**{f"{name}_ms": round(ms, 2) for name, ms in medians.items()},
                                  "packed_gflops": round(flops / medians["packed"] / 1e6),
                                  "onednn_over_packed": round(medians["onednn"] / medians["packed"], 2)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
