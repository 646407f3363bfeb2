"""What a benchmark sends: prompts (text, with their token counts) and how many tokens each asks for.

- ``random``: prompts of ``input_len`` random token ids decoded to text, ``output_len`` new
  tokens; ``range_ratio`` r draws each length uniformly from [len * (1 - r), len * (1 + r)].
- ``mixed``: a short/long mix, e.g. ``64:0.8,1500:0.2`` (length:share), ``output_len`` each.
- ``shared-prefix``: every prompt opens with the same ``prefix_len`` random tokens (what a
  prefix cache and a KV store serve), then ``input_len`` tokens of its own; with
  ``num_prefixes`` N, with one of N such prefixes drawn at random (N system prompts, their users).
- ``jsonl:FILE``: one JSON object a line, ``{"prompt": "...", "output_len": 128}`` (the output
  length optional: ``output_len`` otherwise). A ShareGPT export converts with::

      jq -c '.[] | {prompt: .conversations[0].value}' sharegpt.json > prompts.jsonl
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from duoserve.errors import ConfigError


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]   # text, or token ids (the completions endpoint takes both)
    prompt_len: int           # tokens, by the benchmark's tokenizer
    output_len: int


def _random_text(tokenizer, rng: random.Random, length: int, vocab: int) -> str:
    """Text of ``length`` tokens (re-encoded): random ids from the ordinary vocabulary, decoded;
    decoding merges some neighbours, so the text is re-encoded, cut or topped up, and decoded
    again until it encodes to ``length`` tokens (or a few rounds pass)."""
    ids = [rng.randrange(100, vocab) for _ in range(max(length, 1))]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for _ in range(4):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + [rng.randrange(100, vocab) for _ in range(length - len(ids))]
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return text


def _lengths(base: int, ratio: float, count: int, rng: random.Random) -> list[int]:
    low, high = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def read_jsonl(path: Path, field: str, wanted: str, parse):
    """``parse(item)`` for every JSON object a line of ``path`` (blank lines skipped); a line that
    does not parse is a ``ConfigError`` naming ``field``, the file and line, and what was ``wanted``."""
    results = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            results.append(parse(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(field, f"{path}:{number}", f"{wanted} ({exc})") from None
    return results


def parse_mix(text: str) -> list[tuple[int, float]]:
    """``64:0.8,1500:0.2`` -> [(64, 0.8), (1500, 0.2)]; shares must sum to 1."""
    try:
        mix = [(int(length), float(share)) for length, share in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ConfigError("dataset", f"mixed:{text}", "mixed:LEN:SHARE,LEN:SHARE,... e.g. mixed:64:0.8,1500:0.2") from None
    if abs(sum(share for _, share in mix) - 1) > 1e-6 or any(length < 1 or share < 0 for length, share in mix):
        raise ConfigError("dataset", f"mixed:{text}", "positive lengths whose shares sum to 1")
    return mix


def build(dataset: str, tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
          prefix_len: int = 0, seed: int = 0, num_prefixes: int = 1) -> list[BenchRequest]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size

    def made(text: str, out: int) -> BenchRequest:
        return BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), out)

    if dataset == "random":
        ins, outs = _lengths(input_len, range_ratio, num_prompts, rng), _lengths(output_len, range_ratio, num_prompts, rng)
        return [made(_random_text(tokenizer, rng, n, vocab), o) for n, o in zip(ins, outs)]
    if dataset.startswith("mixed:"):
        mix = parse_mix(dataset[len("mixed:"):])
        lengths = rng.choices([length for length, _ in mix], weights=[share for _, share in mix], k=num_prompts)
        return [made(_random_text(tokenizer, rng, n, vocab), output_len) for n in lengths]
    if dataset == "shared-prefix":
        if num_prefixes < 1:
            raise ConfigError("num_prefixes", num_prefixes, "a positive number of shared prefixes")
        prefixes = [_random_text(tokenizer, rng, prefix_len, vocab) for _ in range(num_prefixes)]
        # one prefix: no draw (the same prompts as before --num-prefixes for a given seed)
        return [made((prefixes[rng.randrange(num_prefixes)] if num_prefixes > 1 else prefixes[0]) + " "
                     + _random_text(tokenizer, rng, input_len, vocab), output_len) for _ in range(num_prompts)]
    if dataset.startswith("jsonl:"):
        path = Path(dataset[len("jsonl:"):])
        if not path.is_file():
            raise ConfigError("dataset", dataset, "jsonl:FILE with an existing file")
        requests = read_jsonl(path, "dataset", 'a JSON object with "prompt"',
                              lambda item: made(item["prompt"], int(item.get("output_len", output_len))))
        return (requests * (num_prompts // max(len(requests), 1) + 1))[:num_prompts] if requests else []
    raise ConfigError("dataset", dataset, "random, mixed:LEN:SHARE,..., shared-prefix or jsonl:FILE")
