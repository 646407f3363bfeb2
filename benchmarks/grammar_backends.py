"""Grammar libraries side by side on the default model's vocabulary: llguidance, xgrammar, outlines-core.

    python3 -m venv --system-site-packages /tmp/gb && /tmp/gb/bin/pip install xgrammar outlines-core
    /tmp/gb/bin/python benchmarks/grammar_backends.py

For each library: the seconds to read the vocabulary once, then for each schema of
``structured_outputs.SCHEMAS`` the seconds to compile it, and the time to compute the token
mask at every position of a valid document (its tokens fed one by one, the library's own
mask type): median and worst. One thread each (the engine computes masks on one). Also which
schema keywords each refuses (``uniqueItems``, ``not``...) instead of ignoring them.
Prints one JSON document.
"""

from __future__ import annotations

import json
import statistics
import time
from importlib.metadata import version

import torch

from duoserve.model.paths import default_model_path
from duoserve.model.gguf_file import read_gguf
from duoserve.model.tokenizer import byte_alphabet, tokenizer_from_gguf
from structured_outputs import SCHEMAS

VOCAB = 49152
DOCUMENTS = [
    {"name": "Ana Souza", "age": 34, "city": "Lima", "job": "nurse"},
    {"color": "blue", "size": "M", "in_stock": True, "tags": ["cotton", "summer"]},
    {"title": "The Long River", "year": 1987, "rating": 7.5,
     "authors": [{"name": "Li Wei", "age": 60, "city": "Hanoi", "job": "writer"}]},
    {"city": "Oslo", "country": "Norway", "population_millions": 1, "landmarks": ["Opera House", "Vigeland Park"]},
]
REFUSALS = {"uniqueItems": {"type": "array", "uniqueItems": True}, "not": {"not": {"type": "string"}},
            "if/then": {"if": {"type": "string"}, "then": {"maxLength": 2}},
            "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}}}


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def text_of(document: dict) -> str:
    return json.dumps(document, separators=(", ", ": "))


def llguidance_backend(tokenizer):
    import llguidance
    import llguidance.torch as llt

    ll, setup = timed(lambda: llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=VOCAB, eos_token=2))
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    bitmask = llt.allocate_token_bitmask(1, VOCAB)

    def compile_(schema):
        matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        return matcher if not matcher.is_error() else None

    def mask(matcher):
        llt.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(matcher, token):
        assert matcher.consume_token(token), matcher.get_error()

    return {"version": version("llguidance"), "setup": setup, "compile": compile_, "mask": mask, "accept": accept}


def xgrammar_backend(tokenizer):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token="<|im_end|>")
    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def compile_(schema):
        try:
            grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        except Exception:  # noqa: BLE001 - a refused schema
            return None
        return xgr.GrammarMatcher(grammar)

    def mask(matcher):
        matcher.fill_next_token_bitmask(bitmask)

    def accept(matcher, token):
        assert matcher.accept_token(token)

    return {"version": version("xgrammar"), "setup": setup, "compile": compile_, "mask": mask, "accept": accept}


def outlines_backend(tokenizer):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    bytes_of = {c: b for b, c in byte_alphabet().items()}
    special = tokenizer.special_token_ids

    def make_vocabulary():
        tokens: dict[bytes, list[int]] = {}
        for token_id in range(tokenizer.vocab_size):
            if token_id in special:
                continue
            text = tokenizer.backend.id_to_token(token_id)
            tokens.setdefault(bytes(bytes_of[c] for c in text), []).append(token_id)
        return Vocabulary(2, tokens)

    vocabulary, setup = timed(make_vocabulary)

    def compile_(schema):
        try:
            return Guide(Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), vocabulary))
        except Exception:  # noqa: BLE001 - a refused schema
            return None

    def mask(guide):
        guide.get_tokens()

    def accept(guide, token):
        guide.advance(token)

    return {"version": version("outlines-core"), "setup": setup, "compile": compile_,
            "mask": mask, "accept": accept}


def measure(backend, tokenizer) -> dict:
    result = {"version": backend["version"], "vocabulary_setup_s": round(backend["setup"], 3), "schemas": []}
    for schema, document in zip(SCHEMAS, DOCUMENTS):
        matcher, seconds = timed(lambda: backend["compile"](schema))
        entry = {"compile_ms": round(1000 * seconds, 2)}
        if matcher is None:
            entry["refused"] = True
            result["schemas"].append(entry)
            continue
        times = []
        for token in tokenizer.encode(text_of(document)):
            times.append(timed(lambda: backend["mask"](matcher))[1])
            backend["accept"](matcher, token)
        entry.update(tokens=len(times), mask_median_ms=round(1000 * statistics.median(times), 4),
                     mask_first_ms=round(1000 * times[0], 3), mask_max_ms=round(1000 * max(times), 3))
        result["schemas"].append(entry)
    result["refuses"] = {name: backend["compile"](schema) is None for name, schema in REFUSALS.items()}
    return result


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = tokenizer_from_gguf(read_gguf(default_model_path()).meta, (2,))
    results = {}
    for name, make in (("llguidance", llguidance_backend), ("xgrammar", xgrammar_backend),
                       ("outlines-core", outlines_backend)):
        try:
            backend = make(tokenizer)
        except ImportError as exc:
            results[name] = {"not installed": str(exc)}
            continue
        results[name] = measure(backend, tokenizer)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
