"""Routing by prefix against least-loaded: two colocated engines, several system prompts.

    python benchmarks/routing_prefix.py [--num-prefixes 16] [--num-prompts 160] [--rounds 2]

Starts ``duoserve serve --num-engines 2`` (each engine on one core) with a KV pool small enough
that one engine cannot hold every system prompt (``--kv-cache-memory``), once with
``--routing least-loaded`` and once with ``--routing prefix`` (the default), and sends each the same
``shared-prefix`` workload (``--num-prefixes`` prompts of ``--prefix-len`` tokens, each request one of
them drawn at random plus ``--input-len`` tokens of its own) through ``duoserve bench serve`` at
``--max-concurrency``. Prints, for each, the prefix cache's hit rate (tokens found cached over
tokens asked, both engines), TTFT p50/p99, output tok/s and failures, as one JSON document.
``--rounds N`` runs the pair N times, alternated (``least-loaded#1``, ``prefix#1``, ...): on a
drifting machine compare within a round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from serve_vs_peers import Running


def measure(routing: str, args: argparse.Namespace) -> dict:
    """One server with ``--routing routing``, the workload through it; its figures."""
    server = Running(["duoserve", "serve", "--port", "8304", "--num-engines", "2", "--routing", routing,
                      "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", args.max_model_len], 8304)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "duoserve", "bench", "serve", "--base-url", "http://127.0.0.1:8304",
                            "--dataset", "shared-prefix", "--num-prefixes", str(args.num_prefixes),
                            "--prefix-len", str(args.prefix_len), "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--ignore-eos",
                            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                            "--result-json", out.name, "--quiet"], check=True, stdout=subprocess.DEVNULL)
            result = json.loads(Path(out.name).read_text())
    finally:
        server.stop()
    server_side = result.get("server") or {}
    return {"prefix_cache_hit_rate": round(server_side.get("prefix_cache_hit_rate", 0.0), 3),
            "ttft_p50_ms": round(result["ttft_ms"]["p50"], 1),
            "ttft_p99_ms": round(result["ttft_ms"]["p99"], 1),
            "output_tok_s": round(result["output_throughput"], 1),
            "completed": result["completed"], "failed": result["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=160)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="0.1", help="GiB a engine (default: 0.1)")
    parser.add_argument("--max-model-len", default="2048")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    results = {"workload": vars(args)}
    for round_ in range(1, args.rounds + 1):
        for routing in ("least-loaded", "prefix"):
            results[routing if args.rounds == 1 else f"{routing}#{round_}"] = measure(routing, args)
            print(json.dumps(results, indent=2), file=sys.stderr, flush=True)   # so far, should a round fail
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
