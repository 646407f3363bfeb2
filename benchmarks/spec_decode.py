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
(a request's last chunk minus its first, over its tokens after the first), output tokens/s,
whether each text equals the ``off`` configuration's, and the acceptance read from
``/metrics``. Requests go through ``duoserve bench``'s client. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from _common import DuoserveServer

from duoserve.bench.client import run
from duoserve.bench.report import summarize
from duoserve.bench.workloads import BenchRequest

CONFIGS = {
    "off": [],
    "draft": ["--speculative-method", "draft", "--speculative-quantization", "gguf"],
    "ngram": ["--speculative-method", "ngram"],
}
PROMPTS = json.loads((Path(__file__).parent / "data" / "spec_prompts.json").read_text())


def workload(name: str, max_tokens: int) -> tuple[list[BenchRequest], str, int]:
    """(requests, endpoint, streams) of a workload."""
    kind = name.rstrip("0123456789")
    if kind in ("chat", "grounded"):  # chatN: the chat prompts at N streams, 2N requests
        streams = int(name[len(kind):] or 1)
        prompts = PROMPTS[kind] * (2 * streams // len(PROMPTS[kind]) + 1) if streams > 1 else PROMPTS[kind]
        return ([BenchRequest(p, 0, max_tokens) for p in prompts[:max(2 * streams, 8)]], "/v1/chat/completions",
                streams)
    streams = int(name[1:])  # cN: N streams of random 128-token prompts (as vllm bench serve's), 2N requests
    rng = random.Random(0)
    return ([BenchRequest([rng.randrange(100, 49000) for _ in range(128)], 128, max_tokens) for _ in range(2 * streams)],
            "/v1/completions", streams)


def measure(server: DuoserveServer, name: str, max_tokens: int) -> dict:
    requests, endpoint, streams = workload(name, max_tokens)
    # a copied passage ends where the model says it does; the others generate max_tokens exactly
    ignore_eos = name != "grounded"

    def load(chosen):
        return asyncio.run(run(server.url, endpoint, "smollm2-135m", chosen, float("inf"), max_concurrency=streams,
                               ignore_eos=ignore_eos))

    load(requests[:2])  # warm: first compiles, caches
    drafts = server.metric("duoserve:spec_decode_num_draft_tokens_total")
    accepted = server.metric("duoserve:spec_decode_num_accepted_tokens_total")
    records, seconds = load(requests)
    drafts = server.metric("duoserve:spec_decode_num_draft_tokens_total") - drafts
    accepted = server.metric("duoserve:spec_decode_num_accepted_tokens_total") - accepted
    result = summarize(records, seconds, {}, {})
    return {"median_tpot_ms": result["tpot_ms"]["p50"], "output_tok_s": result["output_throughput"],
            "tokens": result["total_output_tokens"], "acceptance": accepted / drafts if drafts else None,
            "texts": [r.text for r in records]}


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
        server = DuoserveServer(["--max-model-len", "2048", *flags], 8311)
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
