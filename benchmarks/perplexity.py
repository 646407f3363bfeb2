"""Perplexity of the default model on a fixed text, with each weight option.

    python benchmarks/perplexity.py [--dtype float32] [--window 512]

The text is ``benchmarks/data/perplexity.txt`` (a snapshot of this repository's
docs/architecture.md, about 3,000 tokens), cut into windows of ``--window`` tokens, each
scored from its second token (prompt log-probabilities, no prefix caching across windows).
Every row count computes from the blocks in the same arithmetic, so the default step budget
scores the windows as a decode step would.
Prints perplexity per option and its change against the dequantized model (``none``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
OPTIONS = [("none", "fast"), ("gguf", "exact"), ("gguf", "fast"), ("int8", "fast")]


def perplexity(llm, windows: list[list[int]]) -> float:
    from duoserve import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate(windows, params, use_tqdm=False)
    logprobs = [entry.logprob for out in outs for entry in out.prompt_logprobs if entry is not None]
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    from duoserve import LLM

    results = {}
    for quantization, mode in OPTIONS:
        llm = LLM(dtype=args.dtype, quantization=quantization, gguf_mode=mode, max_model_len=2048,
                  kv_cache_memory=0.5, enable_prefix_caching=False)
        tokens = llm.engine.tokenizer.encode(TEXT.read_text())
        windows = [tokens[i:i + args.window] for i in range(0, len(tokens) - args.window + 1, args.window)]
        name = quantization if quantization != "gguf" else f"gguf-{mode}"
        results[name] = {"perplexity": round(perplexity(llm, windows), 4), "tokens": sum(len(w) - 1 for w in windows)}
        del llm
    base = results["none"]["perplexity"]
    for value in results.values():
        value["vs_none_pct"] = round((value["perplexity"] / base - 1) * 100, 3)
    print(json.dumps({"dtype": args.dtype, "window": args.window, **results}, indent=2))


if __name__ == "__main__":
    main()
