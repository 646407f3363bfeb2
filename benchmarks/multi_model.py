"""Several models behind one server, with the real files: the default model and Gemma 3 270M.

    python benchmarks/fetch_models.py --only gemma-3-270m
    python benchmarks/multi_model.py [--gemma ~/models/gemma-3-270m-q4_k_m.gguf]

``equal``: each model alone on its own server completes 8 prompts (greedy, 48 tokens, 8 at
once); then one server with both (``--model smol=... --model gemma=...``) answers the same 16,
interleaved at 8 streams. Every text must equal its single-model server's.

``models-max``: the same server with ``--models-max 1``, 8 requests alternating between the two
models, one at a time: each request after the first loads its model and unloads the other.
Loads and unloads as /metrics counts them, failed requests, and the median time of a request that
had to load its model against one that did not.

``sleep``: a server with both models and ``--sleep-idle-seconds 5``: the resident size of its
whole process tree while both are loaded, after both slept (their engines gone from the process
table), and the weights and KV that /v1/memory said they held; then the time of the request that
wakes one. Prints one JSON document. No flags but these: the files computed from their blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _common import DuoserveServer

PORT = 8331
PROMPTS = ["The sea at night is", "The capital of Japan is", "Recursion means that", "Three prime numbers are",
           "In French, hello is", "Twelve times seven is", "A famous painter was", "Another word for happy is"]


def chat(url: str, model: str | None, prompt: str) -> tuple[str, float]:
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0}   # completions: Gemma 3 270M's file has no
    if model:                                                         # chat template
        body["model"] = model
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=900, headers={"Connection": "close"})
    response.raise_for_status()
    return response.json()["choices"][0]["text"], time.monotonic() - start


def metric(url: str, name: str, labels: dict) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


def part_equal(models: dict[str, str]) -> dict:
    alone = {}
    for name, path in models.items():
        server = DuoserveServer(["--model", path], PORT)
        try:
            with ThreadPoolExecutor(8) as pool:
                alone[name] = [text for text, _ in pool.map(lambda p: chat(server.url, None, p), PROMPTS)]
        finally:
            server.stop()
    server = DuoserveServer([arg for name, path in models.items() for arg in ("--model", f"{name}={path}")], PORT)
    try:
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in models]   # interleaved
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda job: chat(server.url, job[0], PROMPTS[job[1]])[0], jobs))
    finally:
        server.stop()
    together = {name: [t for (n, _), t in zip(jobs, texts) if n == name] for name in models}
    return {"requests": len(jobs), "streams": 8,
            "equal": {name: sum(a == b for a, b in zip(alone[name], together[name])) for name in models},
            "of": len(PROMPTS)}


def part_models_max(models: dict[str, str]) -> dict:
    names = list(models)
    server = DuoserveServer([*[arg for n, p in models.items() for arg in ("--model", f"{n}={p}")],
                             "--models-max", "1"], PORT)
    switched, kept, failed = [], [], 0
    try:
        chat(server.url, names[0], PROMPTS[0])
        for i in range(8):
            name = names[(i + 1) % 2]
            try:
                switched.append(chat(server.url, name, PROMPTS[i])[1])
                kept.append(chat(server.url, name, PROMPTS[(i + 1) % 8])[1])   # the same model again: no load
            except httpx.HTTPError:
                failed += 1
        counts = {"loads": {n: metric(server.url, "duoserve:model_loads_total", {"model_name": n}) for n in names},
                  "unloads": {n: metric(server.url, "duoserve:model_unloads_total", {"model_name": n}) for n in names}}
    finally:
        server.stop()
    return {"alternations": 8, "failed": failed, **counts, "median_request_that_loaded_s": statistics.median(switched),
            "median_request_on_a_loaded_model_s": statistics.median(kept)}


def part_sleep(models: dict[str, str]) -> dict:
    server = DuoserveServer([*[arg for n, p in models.items() for arg in ("--model", f"{n}={p}")],
                             "--sleep-idle-seconds", "5"], PORT)
    try:
        for name in models:
            chat(server.url, name, PROMPTS[0])
        memory = httpx.get(f"{server.url}/v1/memory", timeout=10).json()
        held = sum(sum(r["weights_bytes"].values()) + r["kv_pool"]["resident_bytes"]
                   for r in memory["engines"].values())
        reserved_kv = sum(r["kv_pool"]["bytes"] for r in memory["engines"].values())
        awake = tree_rss(server.proc.pid)
        while {m["status"]["value"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]} != {
                "sleeping"}:
            time.sleep(0.5)
        asleep = tree_rss(server.proc.pid)
        freed = {n: m["freed_bytes"] for n, m in httpx.get(f"{server.url}/v1/memory", timeout=10).json()[
            "models"].items()}
        _, wake_s = chat(server.url, next(iter(models)), PROMPTS[1])
    finally:
        server.stop()
    mib = 2 ** 20
    return {"tree_rss_awake_mib": awake / mib, "tree_rss_asleep_mib": asleep / mib,
            "dropped_mib": (awake - asleep) / mib, "weights_and_resident_kv_mib": held / mib,
            "kv_reserved_mib": reserved_kv / mib, "freed_reported_mib": {n: f / mib for n, f in freed.items()},
            "request_that_woke_s": wake_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemma", default=os.path.expanduser("~/models/gemma-3-270m-q4_k_m.gguf"))
    parser.add_argument("--parts", default="equal,models-max,sleep")
    args = parser.parse_args()
    models = {"smol": "smollm2-135m", "gemma": args.gemma}
    parts = {"equal": part_equal, "models-max": part_models_max, "sleep": part_sleep}
    print(json.dumps({part: parts[part](models) for part in args.parts.split(",")}, indent=2))


if __name__ == "__main__":
    main()
