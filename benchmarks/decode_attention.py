"""The C decode-attention kernel of a git revision against the working tree's, one layer's call at a time.

    python benchmarks/decode_attention.py --before HEAD~1 --dtype float32

The revision's ``csrc/paged_decode.c`` is built with the engine's flags, the working tree's is
the engine's own build (``cpu_kernels.paged_decode_kernel``); both are called through ctypes on
the same caches: the default model's shape (9 query heads, 3 KV
heads of 64), 30 layers' caches so that each call reads its rows from memory as a step does,
every sequence ``--context`` tokens long in randomly placed blocks of 16. For 1, 4 and 32
sequences, the median time of the 30 layers' calls, the kernels alternated. Prints JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[1] / "duoserve" / "kernels" / "csrc"


def build_revision(source: str, headers: dict[str, str], out: Path, like):
    """The kernel of an older paged_decode.c, built with the engine's flags; typed as ``like``, less
    the window and cap arguments where that revision has none."""
    from duoserve.kernels.build import C_FLAGS

    work = out.parent / out.stem
    work.mkdir()
    for name, text in {**headers, "paged_decode.c": source}.items():
        (work / name).write_text(text)
    subprocess.run(["gcc", *C_FLAGS, "-shared", str(work / "paged_decode.c"), "-o", str(out), "-lm"], check=True)
    fn = ctypes.CDLL(str(out)).paged_decode_attention
    fn.restype, fn.argtypes = like.restype, like.argtypes
    if "int window, float cap" not in source:
        fn.argtypes = [*like.argtypes[:-3], like.argtypes[-1]]
        return lambda *args: fn(*args[:-3], args[-1])
    return fn


def old_source(root: Path, revision: str) -> str:
    """paged_decode.c at ``revision``: under duoserve/kernels/csrc, or duoserve/model/csrc before the move."""
    for folder in ("duoserve/kernels/csrc", "duoserve/model/csrc"):
        found = subprocess.run(["git", "show", f"{revision}:{folder}/paged_decode.c"], cwd=root,
                               capture_output=True, text=True)
        if found.returncode == 0:
            return found.stdout
    raise SystemExit(f"no paged_decode.c at {revision}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="git revision of the kernel to compare against")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from duoserve.kernels.attention import paged_decode_kernel

    root = CSRC.parents[2]
    old = old_source(root, args.before)
    headers = {h.name: h.read_text() for h in CSRC.glob("*.h")}
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim, block_size, layers = 9, 3, 64, 16, 30
    result = {"before": args.before, "dtype": args.dtype, "context": args.context}
    with tempfile.TemporaryDirectory() as tmp:
        after = paged_decode_kernel()   # the working tree's, as the engine builds it
        if after is None:
            raise SystemExit("the C decode kernel cannot be built here (no C compiler?)")
        kernels = {"before": build_revision(old, headers, Path(tmp) / "before.so", after), "after": after}
        rng = random.Random(0)
        for num_seqs in (1, 4, 32):
            blocks_per_seq = -(-args.context // block_size)
            num_blocks = num_seqs * blocks_per_seq
            caches = [(torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype),
                       torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)) for _ in range(layers)]
            order = list(range(num_blocks))
            rng.shuffle(order)
            tables = torch.tensor(order, dtype=torch.long).view(num_seqs, blocks_per_seq)
            lens = torch.full((num_seqs,), args.context, dtype=torch.long)
            q = torch.randn(num_seqs, heads, head_dim)
            outs = {name: torch.empty_like(q) for name in kernels}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(30):
                for name, fn in kernels.items():
                    start = time.perf_counter()
                    for k, v in caches:
                        fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(dtype == torch.bfloat16), tables.data_ptr(),
                           lens.data_ptr(), outs[name].data_ptr(), num_seqs, heads, kv_heads, head_dim, block_size,
                           blocks_per_seq, head_dim ** -0.5, 0, 0.0, args.threads)
                    times[name].append((time.perf_counter() - start) * 1000)
            before, after = (statistics.median(times[n]) for n in ("before", "after"))
            result[f"{num_seqs} sequences"] = {
                "before_ms": round(before, 3), "after_ms": round(after, 3), "after_over_before": round(after / before, 3),
                "max_abs_difference": float((outs["before"] - outs["after"]).abs().max())}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
