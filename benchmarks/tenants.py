"""Many users, one box (issue 63): two tenants on a server past its capacity, and a priority-0
request arriving at a full batch. Each scenario starts its own `duoserve serve` on the default
model (the flags named below, nothing else) and prints JSON.

    python benchmarks/tenants.py tenants --policies fcfs,fair --duration 60 --cap 32
    python benchmarks/tenants.py priority --streams 128

tenants: the light tenant alone first (its key, Poisson arrivals at ``--light-rate``), then the
light and the heavy tenant together, the heavy one at ``--heavy-factor`` times the light one's
rate, for each policy. Every request: ``--input-len`` random tokens in, ``--output-len`` out
(ignore_eos), greedy; the light tenant's streamed, the heavy tenant's not (a batch job: its
hundreds of streams would cost this client, on the same cores, more than the server). Reported:
the light tenant's TTFT (median, p99, the worst five; alone and mixed), the heavy tenant's share
of the output tokens and its tokens a second over the run, and every request that did not finish.
``--cap N`` adds a run under fair with ``--max-waiting-per-tenant N``: the heavy tenant's excess
refused, each 429 checked for its Retry-After.

priority: ``--streams`` priority-10 streams fill the batch (the server's --max-num-seqs),
then ``--urgent`` priority-0 requests are sent one after another; their TTFT against the same
requests on the idle server, and every priority-10 stream's text against a run of the same
streams with no urgent request (greedy: preempted streams must end with the same text).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import DuoserveServer  # noqa: E402

from duoserve.bench import client, workloads  # noqa: E402
from duoserve.bench.serve import load_tokenizer  # noqa: E402

LIGHT, HEAVY = "light-key", "heavy-key"
ENDPOINT = "/v1/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def ttfts(records: list[client.RequestRecord]) -> list[float]:
    return [r.chunk_times[0] - r.start for r in records if r.ok]


def summary(records: list[client.RequestRecord]) -> dict:
    times = ttfts(records)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    # finished: no error (a stream of special tokens only has no text chunk, so no TTFT, yet it ended)
    return {"requests": len(records), "finished": sum(r.error is None for r in records), "errors": errors,
            "ttft_median_s": round(statistics.median(times), 3) if times else None,
            "ttft_p99_s": round(p99(times), 3) if times else None,
            "ttft_worst_s": [round(t, 3) for t in sorted(times)[-5:]],
            # in send order: a queue that grows shows as TTFTs that grow third by third
            "ttft_median_by_third_s": [round(statistics.median(part), 3) if part else None
                                       for part in (times[:len(times) // 3], times[len(times) // 3:2 * len(times) // 3],
                                                    times[2 * len(times) // 3:])],
            "output_tokens": sum(r.output_tokens for r in records if r.error is None)}


def start(flags: list[str]) -> DuoserveServer:
    server = DuoserveServer(["--api-key", f"{LIGHT},{HEAVY}", *flags], free_port())
    # warm-up: the first request of a server pays for lazy set-up
    httpx.post(f"{server.url}{ENDPOINT}", headers=client.auth_headers(LIGHT), timeout=120,
               json={"prompt": "warm up", "max_tokens": 4})
    return server


def send(server: DuoserveServer, key: str, requests, rate: float, seed: int, extra: dict | None = None):
    return client.run(server.url, ENDPOINT, "smollm2-135m", requests, rate, ignore_eos=True, api_key=key,
                      seed=seed, timeout=1800, extra_body=extra)


async def send_unstreamed(server: DuoserveServer, key: str, requests, rate: float, seed: int):
    """``requests`` at Poisson times, not streamed: records with the output tokens and errors only."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=server.url, timeout=1800, limits=limits,
                                 headers=client.auth_headers(key)) as http:
        async def one(request, record):
            record.start = time.perf_counter()
            try:
                reply = await http.post(ENDPOINT, json={"prompt": request.prompt, "max_tokens": request.output_len,
                                                        "temperature": 0, "ignore_eos": True})
                if reply.status_code == 429:   # said no in time: it must say when to come back
                    record.error = "http_429" if reply.headers.get("retry-after", "").isdigit() else "429_no_retry"
                elif reply.status_code != 200:
                    record.error = f"http_{reply.status_code // 100}xx"
                else:
                    record.output_tokens = reply.json()["usage"]["completion_tokens"]
            except httpx.HTTPError:
                record.error = "connection"
            record.end = time.perf_counter()

        start, tasks, records = time.perf_counter(), [], []
        for request in requests:
            records.append(client.RequestRecord(request.prompt_len, request.output_len))
            tasks.append(asyncio.create_task(one(request, records[-1])))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def tenants(args, tokenizer) -> dict:
    n_light = max(1, int(args.light_rate * args.duration))
    n_heavy = int(n_light * args.heavy_factor)
    # prompts of their own for each run: a prompt sent alone first must not be a prefix-cache hit mixed
    light_alone = workloads.build("random", tokenizer, n_light, args.input_len, args.output_len, seed=1)
    light = workloads.build("random", tokenizer, n_light, args.input_len, args.output_len, seed=11)
    heavy = workloads.build("random", tokenizer, n_heavy, args.input_len, args.output_len, seed=2)
    results = {"config": vars(args) | {"light_requests": n_light, "heavy_requests": n_heavy}}
    runs = [(policy, ["--scheduling-policy", policy]) for policy in args.policies.split(",")]
    if args.cap is not None:
        runs.append((f"fair, --max-waiting-per-tenant {args.cap}",
                     ["--scheduling-policy", "fair", "--max-waiting-per-tenant", str(args.cap)]))
    for policy, policy_flags in runs:
        server = start([*policy_flags, *args.flags])
        try:
            alone, _ = asyncio.run(send(server, LIGHT, light_alone, args.light_rate, seed=3))

            async def mixed():
                return await asyncio.gather(
                    send(server, LIGHT, light, args.light_rate, seed=4),
                    send_unstreamed(server, HEAVY, heavy, args.light_rate * args.heavy_factor, seed=5))

            (light_records, light_s), (heavy_records, heavy_s) = asyncio.run(mixed())
        finally:
            server.stop()
        light_sum, heavy_sum = summary(light_records), summary(heavy_records)
        total = light_sum["output_tokens"] + heavy_sum["output_tokens"]
        results[policy] = {
            "light_alone": summary(alone), "light_mixed": light_sum, "heavy_mixed": heavy_sum,
            "light_ttft_p99_vs_alone": round(light_sum["ttft_p99_s"] / summary(alone)["ttft_p99_s"], 2),
            "heavy_share_of_output_tokens": round(heavy_sum["output_tokens"] / total, 3) if total else None,
            "heavy_tok_s": round(heavy_sum["output_tokens"] / heavy_s, 1),
            "run_s": round(max(light_s, heavy_s), 1)}
        print(json.dumps({policy: results[policy]}), flush=True)
    return results


async def _urgent(server, requests, gap: float) -> list[client.RequestRecord]:
    records = []
    for request in requests:
        got, _ = await send(server, LIGHT, [request], float("inf"), seed=6, extra={"priority": 0})
        records += got
        await asyncio.sleep(gap)
    return records


def priority(args, tokenizer) -> dict:
    streams = workloads.build("random", tokenizer, args.streams, args.input_len, args.output_len, seed=7)
    # the idle run's prompts are not the loaded run's: no prefix-cache hit makes the loaded one look fast
    urgent_idle = workloads.build("random", tokenizer, args.urgent, args.input_len, 16, seed=8)
    urgent = workloads.build("random", tokenizer, args.urgent, args.input_len, 16, seed=10)
    server = start(["--scheduling-policy", "priority", *args.flags])
    try:
        idle = asyncio.run(_urgent(server, urgent_idle, 0.2))
        reference, reference_s = asyncio.run(send(server, HEAVY, streams, float("inf"), seed=9,
                                                  extra={"priority": 10}))

        async def loaded():
            background = asyncio.create_task(send(server, HEAVY, streams, float("inf"), seed=9,
                                                  extra={"priority": 10}))
            await asyncio.sleep(args.settle)   # every stream past its first token: the batch is full
            urgent_records = await _urgent(server, urgent, args.gap)
            return await background, urgent_records

        (busy, _), urgent_records = asyncio.run(loaded())
    finally:
        server.stop()
    same = sum(a.ok and b.ok and a.text == b.text for a, b in zip(reference, busy))
    idle_sum, loaded_sum = summary(idle), summary(urgent_records)
    result = {"config": vars(args), "urgent_idle": idle_sum, "urgent_at_full_batch": loaded_sum,
              "ttft_median_vs_idle": round(loaded_sum["ttft_median_s"] / idle_sum["ttft_median_s"], 2),
              "ttft_p99_vs_idle": round(loaded_sum["ttft_p99_s"] / idle_sum["ttft_p99_s"], 2),
              "streams": summary(busy), "streams_text_equal_to_unpreempted": f"{same}/{len(streams)}",
              "streams_alone_tok_s": round(summary(reference)["output_tokens"] / reference_s, 1)}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["tenants", "priority"])
    parser.add_argument("--policies", default="fcfs,fair")
    parser.add_argument("--light-rate", type=float, default=1.0, help="the light tenant's requests a second")
    parser.add_argument("--heavy-factor", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cap", type=int, default=None, help="also run fair with this --max-waiting-per-tenant")
    parser.add_argument("--streams", type=int, default=128, help="priority-10 streams (fill the batch)")
    parser.add_argument("--urgent", type=int, default=10, help="priority-0 requests, one after another")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between urgent requests")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds before the first urgent request")
    parser.add_argument("--flag", dest="flags", action="append", default=[],
                        help="a server flag (repeat: --flag=--max-num-seqs --flag=16)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    started = time.time()
    result = tenants(args, tokenizer) if args.scenario == "tenants" else priority(args, tokenizer)
    result["wall_s"] = round(time.time() - started, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
