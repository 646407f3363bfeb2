"""Disaggregated vs colocated serving under a mixed workload, at equal total cores.

    python benchmarks/disagg_vs_colocated.py --search-rates 0.5,0.575,0.65,0.8 --num-requests 60 \
        --setups colocated,disagg-auto
    python benchmarks/disagg_vs_colocated.py --rate 0.575 --num-requests 60 --setups colocated,disagg-auto

Workload and client: ``duoserve bench``'s (``mixed:64:0.8,1500:0.2``: 80 % short prompts
of 64 tokens, 20 % long ones of 1,500, 128 output tokens with ``ignore_eos``, Poisson
arrivals at ``--rate`` requests/s, the same seed for every setup). Setups (``SETUPS``):
colocated (one engine, 2 threads, chunked prefill, budget 512); disaggregated as a user gets
it (every prompt on the prefill engine, both roles taking turns on every core), with
``--prefill-device auto`` (each prompt placed by predicted time to first token), and with
the cores split between the roles. A setup named twice runs twice (the VM drifts: alternate
them). Reports TTFT p50/p99 for short and long prompts, ITL p50/p99, output throughput and
the CPU seconds of the server's processes (``cpu_s``: what a setup spends on the same work),
per setup, as JSON.

``--search-rates`` first runs colocated at each rate, lowest first, and takes the highest it
sustains: the short prompts' median TTFT over the run's last third at most twice the first
third's plus 0.5 s (past its limit a server's queue, and so its waits, grow with every
arrival; output tok/s of a short run counts the drain after the last arrival and reads low
even where the server keeps up). Every setup then runs at that rate times
``--search-fraction`` (1.0: the rate nearest colocated's limit, where its chunk steps set its
ITL p99); the report says which rate was used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from _common import DuoserveServer

SETUPS = {
    "colocated": ["--mode", "colocated", "--num-threads", "2", "--max-num-batched-tokens", "512"],
    "disagg": ["--mode", "disaggregated"],     # what a user gets: every prompt remote, every core in turns
    "disagg-auto": ["--mode", "disaggregated", "--prefill-device", "auto"],   # placed by predicted TTFT
    "disagg-split": ["--mode", "disaggregated", "--core-sharing", "split"],   # a core for each role
    "disagg-auto-split": ["--mode", "disaggregated", "--prefill-device", "auto", "--core-sharing", "split"],
}


def add_workload_args(parser: argparse.ArgumentParser, rate: float, num_requests: int) -> None:
    """The mixed workload's flags (shared with ray_vs_local.py)."""
    parser.add_argument("--rate", type=float, default=rate)
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def workload(args, tokenizer):
    """The mixed workload as ``duoserve bench`` builds it (the same for every setup)."""
    from duoserve.bench.workloads import build

    return build(f"mixed:{args.short_len}:0.8,{args.long_len}:0.2", tokenizer, args.num_requests, 0,
                 args.max_tokens, seed=args.seed)


def drive(port: int, requests, args) -> dict:
    """One run through ``duoserve bench``'s client; TTFT split by prompt kind (short, long)."""
    from duoserve.bench.client import run
    from duoserve.bench.report import summarize

    records, seconds = asyncio.run(run(f"http://127.0.0.1:{port}", "/v1/completions", "smollm2-135m", requests,
                                       args.rate, ignore_eos=True, seed=args.seed))
    result = summarize(records, seconds, {}, {})
    report = {"output_tok_s": result["output_throughput"], "failed": result["failed"],
              "itl_p50_ms": result["itl_ms"]["p50"], "itl_p99_ms": result["itl_ms"]["p99"]}
    threshold = (args.short_len + args.long_len) / 2
    short = [r for r in records if r.ok and r.prompt_len < threshold]
    answered = sorted((r for r in short if r.chunk_times), key=lambda r: r.start)
    third = max(len(answered) // 3, 1)
    report["ttft_short_p50_by_third_ms"] = [
        round(1000 * statistics.median(r.chunk_times[0] - r.start for r in part))
        for part in (answered[:third], answered[third:-third] or answered, answered[-third:])] if answered else []
    for kind, chosen in (("short", short), ("long", [r for r in records if r.ok and r.prompt_len >= threshold])):
        ttft = summarize(chosen, seconds, {}, {})["ttft_ms"]
        report[f"ttft_{kind}_p50_ms"], report[f"ttft_{kind}_p99_ms"] = ttft["p50"], ttft["p99"]
    return report


def server_report(port: int) -> dict:
    """From the server's metrics: the mean TTFT by stage, the preemptions, how many prompts were
    prefilled where (an engine, or local), and the placement's median error (measured minus
    predicted TTFT, as the upper bound of the histogram bucket that holds it; the histogram has
    negative buckets, so no sum) by where."""
    import httpx

    counts, buckets, stages, preempted = {}, {}, {}, 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith(("duoserve:ttft_stage_seconds_sum{", "duoserve:ttft_stage_seconds_count{")):
            stage, kind = line.split('stage="')[1].split('"')[0], line.split("{")[0].rsplit("_", 1)[1]
            stages.setdefault(stage, {})[kind] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("duoserve:num_preemptions_total"):
            preempted += float(line.rsplit(" ", 1)[1])
        elif line.startswith("duoserve:request_placements_total{"):
            prefill = line.split('prefill_engine="')[1].split('"')[0]
            counts[prefill] = counts.get(prefill, 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("duoserve:placement_ttft_error_seconds_bucket{"):
            le, where = line.split('le="')[1].split('"')[0], line.split('prefill="')[1].split('"')[0]
            buckets.setdefault(where, []).append((float(le), float(line.rsplit(" ", 1)[1])))
    report = {"prefilled_on": counts} if counts else {}
    report["preempted"] = preempted
    report["ttft_stage_mean_ms"] = {stage: round(1000 * v["sum"] / v["count"]) for stage, v in stages.items()
                                    if v.get("count")}
    medians = {}
    for where, cumulative in buckets.items():
        total = max(count for _, count in cumulative)
        if total:
            medians[where] = min(le for le, count in cumulative if count >= total / 2)
    if medians:
        report["prediction_error_median_le_s"] = medians
    return report


def run_setup(name: str, args, requests, port: int) -> dict:
    extra = args.disagg_flags.split() if name.startswith("disagg") else []
    # the model's context and the KV pool a user gets (no --max-model-len: a 2,048-token context
    # made the default pool 4 sequences of it, which a decode engine fills at this load)
    server = DuoserveServer([*SETUPS[name], *extra], port)
    try:
        report = drive(port, requests, args)
        report.update(server_report(port))
        report["cpu_s"] = round(server.cpu_seconds(), 1)   # all its processes: what the setup cost
        return report
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, rate=0.4, num_requests=40)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--disagg-flags", default="",
                        help="more `duoserve serve` flags for the disaggregated setups, e.g. '--prefill-turn 0.4'")
    parser.add_argument("--search-rates", default=None,
                        help="comma-separated rates: find colocated's highest sustained one, then run there")
    parser.add_argument("--search-fraction", type=float, default=1.0,
                        help="run the setups at this fraction of the rate found by --search-rates")
    args = parser.parse_args()
    from duoserve.bench.serve import load_tokenizer

    tokenizer = load_tokenizer(None)
    results = {"num_requests": args.num_requests}
    if args.search_rates:
        sustained = None
        for rate in sorted(float(r) for r in args.search_rates.split(",")):
            args.rate = rate
            report = run_setup("colocated", args, workload(args, tokenizer), 8690)
            thirds = report["ttft_short_p50_by_third_ms"]
            report["sustained"] = bool(thirds) and report["failed"] == 0 and thirds[-1] <= 2 * thirds[0] + 500
            results[f"search_colocated_{rate:g}"] = report
            print(f"search rate {rate:g}", json.dumps(report), file=sys.stderr, flush=True)
            if not report["sustained"]:
                break
            sustained = rate
        if sustained is None:
            raise SystemExit("colocated sustains none of the rates tried")
        results["max_sustained_rate"] = sustained
        args.rate = round(args.search_fraction * sustained, 3)
    results["rate"] = args.rate
    requests = workload(args, tokenizer)
    for i, name in enumerate(args.setups.split(",")):   # a setup named twice runs twice (the VM drifts)
        key = name if name not in results else f"{name}#{i}"
        results[key] = run_setup(name, args, requests, 8700 + i)
        print(key, json.dumps(results[key]), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
