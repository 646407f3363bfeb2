"""Phi-3 and Phi-3.5 (Phi3ForCausalLM; GGUF phi3) against transformers on tiny seeded checkpoints: the
fused qkv_proj and gate_up_proj, longrope's attention factor and its factors (the long ones served
past the original context, 16 tokens here, the short ones within it) and the sliding window.

transformers' Phi-3 takes the long factors for a sequence longer than the original context, at every
position (its generate() recomputes a sequence's KV when it gets there), the short ones otherwise;
an engine serving more than the original context takes the long ones for every sequence
(``rope_params.for_context``): equal for every prompt past the original context, and for every
sequence of an engine that serves the original context only."""

from __future__ import annotations

import random

import pytest
import torch

from duoserve.config import ModelConfig
from duoserve.kernels.linear import GGUFLinear
from duoserve.worker.backends import load_model
from tests.helpers import forward_one, hf_greedy, hf_model
from tests.model.family_checks import (greedy_equal_colocated, greedy_equal_disaggregated,
                                       speculation_and_prompt_logprobs_equal)

ORIGINAL = 16
SHORT = [1.0, 1.05, 1.2, 1.5, 1.9, 2.4, 3.0, 3.7]
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0,
            "short_factor": SHORT, "long_factor": [1.0, 1.4, 2.2, 3.5, 5.5, 8.0, 11.5, 15.0]}
# Phi-3.5-mini: longrope with other factors, a window longer than the original context
LONGROPE_35 = {**LONGROPE, "short_factor": [1.0, 1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.2],
               "long_factor": [1.1, 1.6, 2.4, 3.9, 6.3, 9.2, 12.0, 16.0]}

CASES = {
    "phi3-mini-4k": dict(kind="phi3", sliding_window=8, max_position_embeddings=64),   # no scaling, a window
    "phi3-mini-128k": dict(kind="phi3", rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL,
                           max_position_embeddings=64, sliding_window=None),
    "phi3.5-mini": dict(kind="phi3", rope_parameters=LONGROPE_35, original_max_position_embeddings=ORIGINAL,
                        max_position_embeddings=64, sliding_window=48),
}
MAX_MODEL_LEN = 64


def longrope(case: str) -> bool:
    return "rope_parameters" in CASES[case]


def prompts() -> list[list[int]]:
    """Within the original context and the window, and past both."""
    rng = random.Random(6)
    return [[rng.randrange(256) for _ in range(n)] for n in (4, 14, 30, 40)]


def reference_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def long_prompts(case: str) -> list[list[int]]:
    """The prompts whose transformers' run takes the factors an engine serving 64 tokens takes."""
    return [p for p in prompts() if len(p) > ORIGINAL] if longrope(case) else prompts()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tiny_dir, case):
    path = tiny_dir(**CASES[case])
    ours = load_model(ModelConfig(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN))
    assert ours.arch.architecture == "Phi3ForCausalLM"
    assert ours.arch.rope.rope_type == ("longrope" if longrope(case) else "default")
    prompt = prompts()[-1]
    hf = hf_model(path)
    want = reference_logits(hf, prompt)
    assert want.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    assert ours.arch.rope.long_context == longrope(case)
    got = forward_one(ours.model, prompt)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["phi3-mini-128k", "phi3.5-mini"])
def test_within_the_original_context_the_short_factors_equal_transformers(tiny_dir, case):
    """Served with the original context (16 tokens): the short factors, transformers' logits and
    greedy tokens for every sequence that fits it."""
    path = tiny_dir(**CASES[case])
    ours = load_model(ModelConfig(model=str(path), dtype="float32", max_model_len=ORIGINAL))
    assert not ours.arch.rope.long_context
    hf = hf_model(path)
    prompt = prompts()[1]
    assert (forward_one(ours.model, prompt) - reference_logits(hf, prompt)).abs().max().item() < 1e-4
    short = [p[:6] for p in prompts()]
    with torch.no_grad():
        want = [hf_greedy(hf, p, ORIGINAL - 6) for p in short]
    greedy_equal_colocated(path, short, want, ORIGINAL - 6, ORIGINAL, expect_hits=False)  # no whole block


def test_the_long_factors_and_the_window_are_not_vacuous(tiny_dir):
    """The long factors change the logits of a long-context engine, the short ones those of an
    original-context one, and the window every position past it."""
    prompt = prompts()[1]
    def logits(spec, max_model_len=None):
        config = ModelConfig(model=str(tiny_dir(**spec)), dtype="float32", max_model_len=max_model_len)
        return forward_one(load_model(config).model, prompt)
    base = CASES["phi3.5-mini"]
    swapped = {**base, "rope_parameters": {**LONGROPE_35, "long_factor": LONGROPE_35["short_factor"],
                                           "short_factor": LONGROPE_35["long_factor"]}}
    assert (logits(base) - logits(swapped)).abs().max() > 1e-3
    assert (logits(base, ORIGINAL) - logits(swapped, ORIGINAL)).abs().max() > 1e-3
    prompt = prompts()[-1]
    windowless = {**CASES["phi3-mini-4k"], "sliding_window": None}
    windowed = forward_one(load_model(ModelConfig(model=str(tiny_dir(**CASES["phi3-mini-4k"])),
                                                  dtype="float32")).model, prompt)
    full = forward_one(load_model(ModelConfig(model=str(tiny_dir(**windowless)), dtype="float32")).model, prompt)
    assert (windowed[:8] - full[:8]).abs().max() < 1e-5 < (windowed[8:] - full[8:]).abs().max()


@pytest.fixture(scope="module")
def greedy_references(tiny_dir):
    """case -> transformers' 20 greedy tokens (and step logits) for each of its long_prompts."""
    refs = {}
    for case, spec in CASES.items():
        hf = hf_model(tiny_dir(**spec))
        with torch.no_grad():
            refs[case] = [hf_greedy(hf, p, 20) for p in long_prompts(case)]
    return refs


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_chunked_and_prefix_cached(tiny_dir, greedy_references, case):
    greedy_equal_colocated(tiny_dir(**CASES[case]), long_prompts(case), greedy_references[case], 20, MAX_MODEL_LEN)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_disaggregated(tiny_dir, greedy_references, case):
    greedy_equal_disaggregated(tiny_dir(**CASES[case]), long_prompts(case), greedy_references[case], 20,
                               MAX_MODEL_LEN)


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_decoding_and_prompt_logprobs_equal_transformers(tiny_dir, greedy_references, case):
    path = tiny_dir(**CASES[case])
    hf = hf_model(path)
    logits = [reference_logits(hf, p) for p in long_prompts(case)]
    speculation_and_prompt_logprobs_equal(path, long_prompts(case), greedy_references[case], logits, 20, MAX_MODEL_LEN)


def assert_same_or_close(loaded, checkpoint, rel):
    """What the checkpoint has, the file has: None where it has no such factor (phi3-mini-4k has
    no long/short factors; pytest.approx no longer takes None), the file's float32 values within
    `rel` where it has them."""
    if checkpoint is None:
        assert loaded is None
    else:
        assert loaded == pytest.approx(checkpoint, rel=rel)


@pytest.mark.parametrize("case", ["phi3-mini-4k", "phi3.5-mini"])
def test_gguf_phi3_equals_the_checkpoint(tiny_dir, tmp_path, case):
    """A phi3 GGUF file as llama.cpp's converter writes it (attn_qkv, ffn_up holding gate and up,
    rope_factors_long/short, the original context, the attention factor, the window): the
    checkpoint's hyper-parameters and transformers' logits; its Q8_0 blocks computed in place."""
    from tests.model.test_gguf import write_gguf

    path = tiny_dir(**CASES[case])
    checkpoint = load_model(ModelConfig(model=str(path), dtype="float32"))
    out = tmp_path / "phi3.gguf"
    write_gguf(path, out, "F32")
    loaded = load_model(ModelConfig(model=str(out), dtype="float32", max_model_len=MAX_MODEL_LEN))
    assert loaded.arch.sliding_window == checkpoint.arch.sliding_window
    for name, rel in (("short_factor", 1e-7), ("long_factor", 1e-7), ("attention_factor", 1e-6)):
        assert_same_or_close(getattr(loaded.arch.rope, name), getattr(checkpoint.arch.rope, name), rel)
    prompt = prompts()[-1]
    want = reference_logits(hf_model(path), prompt)
    assert (forward_one(loaded.model, prompt) - want).abs().max().item() < 1e-4
    q8 = tmp_path / "phi3-q8.gguf"
    write_gguf(path, q8, "Q8_0")
    dense = load_model(ModelConfig(model=str(q8), dtype="float32", quantization="none", max_model_len=MAX_MODEL_LEN))
    blocks = load_model(ModelConfig(model=str(q8), dtype="float32", quantization="gguf", gguf_mode="exact",
                                    max_model_len=MAX_MODEL_LEN))
    layer = blocks.model.layers[0]
    assert isinstance(layer.qkv, GGUFLinear) and isinstance(layer.gate_up, GGUFLinear)
    dense_logits = forward_one(dense.model, prompt)
    assert (forward_one(blocks.model, prompt) - dense_logits).abs().max().item() < 1e-4


def test_fingerprint_covers_longrope_and_the_window(tiny_dir):
    """Phi-3.5 engines whose long factors or windows differ refuse each other, naming the value."""
    from duoserve.model.fingerprint import describe, describe_difference

    def values(spec):
        loaded = load_model(ModelConfig(model=str(tiny_dir(**spec)), dtype="float32"))
        return describe(loaded.arch, None, loaded.path)

    base = values(CASES["phi3.5-mini"])
    other_factors = {**CASES["phi3.5-mini"], "rope_parameters": {**LONGROPE_35, "long_factor": LONGROPE["long_factor"]}}
    difference = describe_difference("prefill", base, "decode", values(other_factors))
    assert difference.startswith("rope: ") and "'long_factor': (1.1, 1.6" in difference and ";" not in difference
    other_window = {**CASES["phi3.5-mini"], "sliding_window": 40}
    assert describe_difference("prefill", base, "decode", values(other_window)) == (
        "sliding_window: prefill=48, decode=40")


def test_a_window_no_shorter_than_the_context_is_none(tiny_dir):
    """Served with 48 tokens of context, Phi-3.5's window of 48 hides nothing: no window, the same
    logits as the checkpoint without one."""
    windowed = load_model(ModelConfig(model=str(tiny_dir(**CASES["phi3.5-mini"])), dtype="float32", max_model_len=48))
    assert windowed.arch.sliding_window is None and windowed.model.layers[0].attn.window is None
    plain = load_model(ModelConfig(model=str(tiny_dir(**{**CASES["phi3.5-mini"], "sliding_window": None})),
                                   dtype="float32", max_model_len=48))
    prompt = prompts()[-1]
    assert torch.equal(forward_one(windowed.model, prompt), forward_one(plain.model, prompt))
