"""``duoserve bench prompts FILE``: the prompt lengths of a JSONL of requests, and the settings
they suggest.

Each line is ``{"prompt": "..."}`` or ``{"messages": [...]}`` (rendered with the model's chat
template); tokens are counted with the benchmark tokenizer. Suggestions, each with its reason:

- ``--max-num-batched-tokens``: the 90th percentile, rounded up to a multiple of 256 (at least
  512, at most 8192): nine prompts in ten prefill in one step, and a decode step never waits
  behind more than that many prompt tokens.
- ``--max-prefill-len`` (``--prefill-device auto``): the 90th percentile, so that the common
  prompts go to the prefill device and the long tail stays on the decode engines.
- ``--block-size``: 16, or 32 when the median prompt is over 2048 tokens (half the block
  tables to walk, and a short prompt wastes at most 31 slots).
- ``--swap-space``: room for the KV of 8 preempted requests of the 99th percentile length plus
  ``--output-len``, at the model's KV bytes a token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from duoserve.bench.workloads import read_jsonl
from duoserve.errors import ConfigError


def prompt_lengths(path: Path, tokenizer) -> list[int]:
    def text(item: dict) -> str:
        return tokenizer.apply_chat_template(item["messages"]) if "messages" in item else item["prompt"]

    lengths = [len(tokenizer.encode(t, add_special_tokens=False))
               for t in read_jsonl(path, "file", 'JSON objects with "prompt" or "messages"', text)]
    if not lengths:
        raise ConfigError("file", str(path), "at least one request")
    return lengths


def histogram(lengths: list[int], width: int = 40) -> str:
    """Power-of-two bins, a bar each."""
    edges = [0] + [2 ** k for k in range(4, 18)]
    counts = [sum(1 for n in lengths if low < n <= high) for low, high in zip(edges, edges[1:])]
    last = max((i for i, c in enumerate(counts) if c), default=0)
    top = max(counts) or 1
    return "\n".join(f"{edges[i] + 1:>7}-{edges[i + 1]:<7}{counts[i]:>7}  {'#' * round(width * counts[i] / top)}"
                     for i in range(last + 1))


def suggest(lengths: list[int], output_len: int, kv_bytes_per_token: int) -> list[tuple[str, str, str]]:
    """(flag, value, why) for each setting."""
    p50, p90, p99 = (int(np.percentile(lengths, p)) for p in (50, 90, 99))
    budget = min(8192, max(512, -(-p90 // 256) * 256))
    block = 32 if p50 > 2048 else 16
    swap_gib = 8 * (p99 + output_len) * kv_bytes_per_token / 2**30
    return [
        ("--max-num-batched-tokens", str(budget), f"90% of prompts ({p90} tokens or fewer) prefill in one step"),
        ("--max-prefill-len", str(p90), "with --prefill-device auto: 90% of prompts go to the prefill device"),
        ("--block-size", str(block), f"median prompt {p50} tokens" + (" (long: fewer, larger blocks)" if block == 32
                                                                         else "")),
        ("--swap-space", f"{swap_gib:.2f}", f"the KV of 8 preempted requests of {p99} + {output_len} tokens "
                                           f"at {kv_bytes_per_token} bytes a token"),
    ]


def report(path: Path, tokenizer, output_len: int, kv_bytes_per_token: int) -> str:
    lengths = prompt_lengths(path, tokenizer)
    p = {q: int(np.percentile(lengths, q)) for q in (50, 90, 99)}
    lines = [f"{len(lengths)} requests; prompt tokens: min {min(lengths)}, p50 {p[50]}, p90 {p[90]}, p99 {p[99]}, "
             f"max {max(lengths)}", "", f"{'tokens':<15}{'count':>7}", histogram(lengths), "", "suggested:"]
    lines += [f"  {flag:<26}{value:<8}{why}" for flag, value, why in suggest(lengths, output_len, kv_bytes_per_token)]
    return "\n".join(lines)
