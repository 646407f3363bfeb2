"""Prompt tokens' attention: the tiled kernel (csrc/paged_prefill.c) against the decode kernel
taking the same rows one token at a time, in one process.

    python benchmarks/prefill_attention.py --dtype bfloat16
    python benchmarks/prefill_attention.py --dtype float32 --shapes 16x2+16,16x3+500,16x4+500

One call of ``c_decode_attention`` (the engine's C entry point) over the rows of one layer:
each row a query token over its own causal context, as a compiled step announces a prompt
chunk. "tiled": the rows in order, so each sequence's tokens form a run and are tiled; "per
token": the same rows interleaved across sequences (a single sequence's reversed), so no run
forms and every row takes the decode kernel. The default model's heads (9 query heads, 3 KV
heads of 64), blocks of 16 in random places. A shape ``SxN+P``: S sequences of N new tokens
after P cached ones. Median of 7 calls each, alternated, after 3 each to warm up; prints JSON with GFLOP/s (the causal
part only: 4 * heads * head_dim flops per visible key).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch

from duoserve.kernels.attention import c_decode_attention


def rows(num_seqs: int, new: int, cached: int, block_size: int, num_blocks: int):
    tables, lens = [], []
    for _ in range(num_seqs):
        blocks = torch.randperm(num_blocks)[:-(-(cached + new) // block_size)]
        for i in range(new):
            tables.append(blocks)
            lens.append(cached + i + 1)
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
    for i, blocks in enumerate(tables):
        table[i, :len(blocks)] = blocks
    return table, torch.tensor(lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", default="4x128+0,1x512+0,1x512+1536,16x3+500,16x4+500")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype, heads, kv_heads, head_dim, block_size, num_blocks = getattr(torch, args.dtype), 9, 3, 64, 16, 512
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    results = []
    for shape in args.shapes.split(","):
        seqs, rest = shape.split("x")
        new, cached = map(int, rest.split("+"))
        num_seqs = int(seqs)
        table, lens = rows(num_seqs, new, cached, block_size, num_blocks)
        q = torch.randn(len(lens), heads, head_dim).to(dtype).float()
        order = (torch.arange(len(lens)).view(num_seqs, new).t().reshape(-1) if num_seqs > 1
                 else torch.arange(len(lens)).flip(0))
        q_mixed, table_mixed, lens_mixed = q[order], table[order], lens[order]
        times = {"tiled": [], "per_token": []}
        for _ in range(3):   # warm-up: the first calls of a process run far slower
            c_decode_attention(q, k_cache, v_cache, table, lens, scale)
            c_decode_attention(q_mixed, k_cache, v_cache, table_mixed, lens_mixed, scale)
        for _ in range(7):
            start = time.perf_counter()
            c_decode_attention(q, k_cache, v_cache, table, lens, scale)
            times["tiled"].append(time.perf_counter() - start)
            start = time.perf_counter()
            c_decode_attention(q_mixed, k_cache, v_cache, table_mixed, lens_mixed, scale)
            times["per_token"].append(time.perf_counter() - start)
        flops = 4 * heads * head_dim * int(lens.sum())
        entry = {"shape": shape}
        for name, ts in times.items():
            median = statistics.median(ts)
            entry[f"{name}_ms"] = round(median * 1e3, 3)
            entry[f"{name}_gflops"] = round(flops / median / 1e9)
        entry["speedup"] = round(entry["per_token_ms"] / entry["tiled_ms"], 2)
        results.append(entry)
    print(json.dumps({"machine": f"{platform.machine()} {args.threads} threads", "dtype": args.dtype,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
