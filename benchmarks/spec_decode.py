"""Speculative decoding on and off, side by side: single-stream TPOT, throughput, acceptance.

    python benchmarks/spec_decode.py                       # default model, fp32 target
    python benchmarks/spec_decode.py --configs off,draft --workloads chat

Each configuration is a ``duoserve serve`` of its own (default model, ``--quantization none``,
``--dtype float32`` unless changed), started and stopped here, alone on the machine:

- ``off``: no speculation;
- ``draft``: the target's own GGUF file as the draft, computed from its blocks
  (``--speculative-method draft --speculative-quantization gguf``);
- ``ngram``: prompt lookup (``--speculative-method ngram``).

Workloads (``benchmarks/data/spec_prompts.json``): ``chat`` (open questions, one stream),
``grounded`` (repeat / extract / edit a passage of the prompt, one stream), ``cN`` (N
concurrent streams of random 128-token prompts, 2N requests: ``c32``; ``c2``, ``c4``... to find
where speculation stops paying), ``chatN`` (the chat prompts at N streams). Greedy, ``--max-tokens`` new tokens (eos
ignored, except for ``grounded``, whose answers end when the passage does). Per workload: median TPOT
(a request's time after its first token over its tokens after the first), output tokens/s,
whether each text equals the ``off`` configuration's, and the acceptance read from
``/metrics``. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from _common import wait_healthy

CONFIGS = {
    "off": [],
    "draft": ["--speculative-method", "draft", "--speculative-quantization", "gguf"],
    "ngram": ["--speculative-method", "ngram"],
}
PROMPTS = json.loads((Path(__file__).parent / "data" / "spec_prompts.json").read_text())


class Server:
    def __init__(self, flags: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        cmd = ["duoserve", "serve", "--port", str(port), "--no-access-log", "--max-model-len", "2048", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.startup_s = wait_healthy(f"{self.url}/health", 900, lambda: self.proc.poll() is None)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log: {self.log.name}") from None

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first = None
    text, count = [], 0
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream("POST", url + endpoint, json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    tpot = (end - first) / (count - 1) if first and count > 1 else None
    return {"text": "".join(text), "tokens": count, "tpot": tpot, "seconds": end - start}


async def run_load(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def limited(body):
            async with semaphore:
                return await one_request(client, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(b) for b in bodies))
        return results, time.perf_counter() - start


def workload(name: str, max_tokens: int) -> tuple[list[dict], int]:
    # a copied passage ends where the model says it does; the others generate max_tokens exactly
    common = {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": name != "grounded"}
    kind = name.rstrip("0123456789")
    if kind in ("chat", "grounded"):  # chatN: the chat prompts at N streams, 2N requests
        streams = int(name[len(kind):] or 1)
        prompts = PROMPTS[kind] * (2 * streams // len(PROMPTS[kind]) + 1) if streams > 1 else PROMPTS[kind]
        return [{**common, "messages": [{"role": "user", "content": p}]} for p in prompts[:max(2 * streams, 8)]], streams
    streams = int(name[1:])  # cN: N streams of random 128-token prompts (as vllm bench serve's), 2N requests
    rng = random.Random(0)
    return [{**common, "prompt": [rng.randrange(100, 49000) for _ in range(128)]} for _ in range(2 * streams)], streams


def measure(server: Server, name: str, max_tokens: int) -> dict:
    bodies, concurrency = workload(name, max_tokens)
    asyncio.run(run_load(server.url, bodies[:2], concurrency))  # warm: first compiles, caches
    drafts = server.metric("duoserve:spec_decode_num_draft_tokens_total")
    accepted = server.metric("duoserve:spec_decode_num_accepted_tokens_total")
    results, seconds = asyncio.run(run_load(server.url, bodies, concurrency))
    drafts = server.metric("duoserve:spec_decode_num_draft_tokens_total") - drafts
    accepted = server.metric("duoserve:spec_decode_num_accepted_tokens_total") - accepted
    tokens = sum(r["tokens"] for r in results)
    return {"median_tpot_ms": 1000 * statistics.median(r["tpot"] for r in results if r["tpot"]),
            "output_tok_s": tokens / seconds, "tokens": tokens,
            "acceptance": accepted / drafts if drafts else None, "texts": [r["text"] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="off,draft,ngram", help=f"among {', '.join(CONFIGS)}")
    parser.add_argument("--workloads", default="chat,grounded,c32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--serve-args", default="--dtype float32 --quantization none",
                        help="flags of every server (the target)")
    parser.add_argument("--spec-args", default="", help="flags added to the speculating servers, e.g. "
                        "'--num-speculative-tokens 6'")
    args = parser.parse_args()
    results: dict = {}
    for config in args.configs.split(","):
        flags = args.serve_args.split() + CONFIGS[config] + (args.spec_args.split() if CONFIGS[config] else [])
        server = Server(flags, 8311)
        try:
            results[config] = {"startup_s": server.startup_s, "flags": " ".join(flags)}
            for name in args.workloads.split(","):
                results[config][name] = measure(server, name, args.max_tokens)
        finally:
            server.stop()
    reference = results.get("off", {})
    for config, result in results.items():
        for name in args.workloads.split(","):
            run = result[name]
            texts = run.pop("texts")
            if config != "off" and name in reference:
                base = reference[name]
                run["same_text_as_off"] = f"{sum(a == b for a, b in zip(texts, base['texts_kept']))}/{len(texts)}"
                run["tpot_vs_off"] = run["median_tpot_ms"] / base["median_tpot_ms"]
                run["throughput_vs_off"] = run["output_tok_s"] / base["output_tok_s"]
            if config == "off":
                run["texts_kept"] = texts
    for run in reference.values():
        if isinstance(run, dict):
            run.pop("texts_kept", None)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
