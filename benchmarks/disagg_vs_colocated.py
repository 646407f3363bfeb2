"""Disaggregated vs colocated serving under a mixed workload, at equal total cores.

    python benchmarks/disagg_vs_colocated.py --search-rates 0.2,0.3,0.4,0.5 --num-requests 30
    python benchmarks/disagg_vs_colocated.py --rate 0.3 --num-requests 30

Workload: 80 % short prompts (~64 tokens), 20 % long ones (~1,500 tokens), 128 output
tokens (``ignore_eos``), Poisson arrivals at ``--rate`` requests/s, the same seed for
every setup. Setups: colocated (one engine, 2 threads, chunked prefill, budget 512);
disaggregated with a prefill engine on core 0 and a decode engine on core 1, with
``--prefill-device cpu`` and with ``auto``. Reports TTFT p50/p99 for short and long
prompts, ITL p50/p99 and output throughput, per setup, as JSON.

``--search-rates`` first runs colocated at each rate and takes the highest it sustains
(output throughput at least 90 % of the offered rate x max_tokens), then runs every setup
at 70 % of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import httpx
from _common import wait_healthy

SETUPS = {
    "colocated": ["--mode", "colocated", "--num-threads", "2", "--max-num-batched-tokens", "512"],
    "disagg-cpu": ["--mode", "disaggregated", "--prefill-device", "cpu", "--prefill-threads", "1",
                   "--decode-threads", "1", "--prefill-cpus", "0", "--decode-cpus", "1"],
    "disagg-cpu-256": ["--mode", "disaggregated", "--prefill-device", "cpu", "--prefill-threads", "1",
                       "--decode-threads", "1", "--prefill-cpus", "0", "--decode-cpus", "1",
                       "--prefill-max-num-batched-tokens", "256"],
    "disagg-auto": ["--mode", "disaggregated", "--prefill-device", "auto", "--prefill-threads", "1",
                    "--decode-threads", "1", "--prefill-cpus", "0", "--decode-cpus", "1"],
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def workload(args) -> list[tuple[float, list[int], str]]:
    rng = random.Random(args.seed)
    t, items = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        kind = "long" if rng.random() < 0.2 else "short"
        length = args.long_len if kind == "long" else args.short_len
        items.append((t, [rng.randrange(1000, 40000) for _ in range(length)], kind))
    return items


async def one(http: httpx.AsyncClient, at: float, prompt: list[int], kind: str, start: float, args) -> dict:
    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
    sent = time.monotonic()
    times = []
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return {"kind": kind, "ttft": times[0] - sent, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": len(times), "end": times[-1]}


async def drive(port: int, items, args) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
        start = time.monotonic()
        results = await asyncio.gather(*(one(http, at, p, k, start, args) for at, p, k in items))
    end = max(r["end"] for r in results)
    report = {"output_tok_s": sum(r["tokens"] for r in results) / (end - start)}
    for kind in ("short", "long"):
        ttfts = [r["ttft"] for r in results if r["kind"] == kind]
        report[f"ttft_{kind}_p50_ms"] = 1000 * statistics.median(ttfts) if ttfts else None
        report[f"ttft_{kind}_p99_ms"] = 1000 * percentile(ttfts, 99) if ttfts else None
    itls = [x for r in results for x in r["itl"]]
    report["itl_p50_ms"] = 1000 * percentile(itls, 50)
    report["itl_p99_ms"] = 1000 * percentile(itls, 99)
    return report


def run_setup(name: str, args, items, port: int) -> dict:
    cmd = [sys.executable, "-m", "duoserve.cli", "serve", "--port", str(port), "--no-access-log",
           "--max-model-len", "2048", *SETUPS[name]]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", 120, lambda: server.poll() is None)
        return asyncio.run(drive(port, items, args))
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.4)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--search-rates", default=None,
                        help="comma-separated rates: find colocated's highest sustained one, then run at 70%%")
    args = parser.parse_args()
    results = {"num_requests": args.num_requests}
    if args.search_rates:
        sustained = None
        for rate in sorted(float(r) for r in args.search_rates.split(",")):
            args.rate = rate
            report = run_setup("colocated", args, workload(args), 8690)
            offered = rate * args.max_tokens
            report["sustained"] = report["output_tok_s"] >= 0.9 * offered
            results[f"search_colocated_{rate:g}"] = report
            print(f"search rate {rate:g}", json.dumps(report), file=sys.stderr, flush=True)
            if not report["sustained"]:
                break
            sustained = rate
        if sustained is None:
            raise SystemExit("colocated sustains none of the rates tried")
        results["max_sustained_rate"] = sustained
        args.rate = round(0.7 * sustained, 3)
    results["rate"] = args.rate
    items = workload(args)
    for i, name in enumerate(args.setups.split(",")):
        results[name] = run_setup(name, args, items, 8700 + i)
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
