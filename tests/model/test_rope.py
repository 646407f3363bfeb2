"""Scaled rotary embeddings (YaRN, dynamic NTK; longrope in test_phi3.py) against transformers, on tiny seeded checkpoints whose
original context (16 tokens) is shorter than the prompts."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from duoserve.config import ModelConfig
from duoserve.errors import ConfigError
from duoserve.worker.backends import load_model
from tests.helpers import forward_one, hf_greedy, hf_model
from tests.model.family_checks import (greedy_equal_colocated, greedy_equal_disaggregated, hf_incremental,
                                       speculation_and_prompt_logprobs_equal)

ORIGINAL = 16
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
# another ramp (beta_fast, beta_slow) and DeepSeek's mscale pair, so the attention factor is not the default
YARN_QWEN2 = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 8.0,
              "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 1000000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}

CASES = {
    "yarn-llama": dict(kind="llama", rope_parameters=YARN),
    "yarn-qwen2": dict(kind="qwen2", rope_parameters=YARN_QWEN2),
    "dynamic-llama": dict(kind="llama", rope_parameters=DYNAMIC, max_position_embeddings=ORIGINAL),
}
# transformers computes this one from each forward's length: the reference is fed a token at a time
# (longrope, the other such type, is Phi-3's: tests/model/test_phi3.py)
LENGTH_DEPENDENT = ("dynamic-llama",)
MAX_MODEL_LEN = 64   # dynamic: the original 16 times its factor 4, all it may serve


def prompts() -> list[list[int]]:
    """Within the original context, and past it (up to 3x)."""
    rng = random.Random(4)
    return [[rng.randrange(256) for _ in range(n)] for n in (5, 15, 23, 40)]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_past_the_original_context(tiny_dir, case):
    """Every position of a 40-token prompt (2.5x the original context): transformers' logits within
    1e-4. Dynamic NTK against transformers fed a token at a time (see rope.py); at once within
    the original context too. And the scaling is not vacuous: the unscaled model differs."""
    path = tiny_dir(**CASES[case])
    ours = load_model(ModelConfig(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN))
    assert ours.arch.rope.rope_type == CASES[case]["rope_parameters"]["rope_type"]
    prompt = prompts()[-1]
    hf = hf_model(path)
    got = forward_one(ours.model, prompt)
    if case in LENGTH_DEPENDENT:
        with torch.no_grad():   # first: transformers' rope keeps the longest length it has seen
            at_once = hf(torch.tensor([prompt[:ORIGINAL]])).logits[0]
        assert (got[:ORIGINAL] - at_once).abs().max().item() < 1e-4
        want, _, _ = hf_incremental(hf, prompt)
    else:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
    assert want.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    assert (got - want).abs().max().item() < 1e-4
    plain = {k: v for k, v in CASES[case].items() if k != "rope_parameters"}
    unscaled = forward_one(load_model(ModelConfig(model=str(tiny_dir(**plain)), dtype="float32",
                                                  max_model_len=MAX_MODEL_LEN, hf_overrides={
                                                      "max_position_embeddings": MAX_MODEL_LEN})).model, prompt)
    assert (unscaled[ORIGINAL:] - got[ORIGINAL:]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def greedy_references(tiny_dir):
    """case -> transformers' 20 greedy tokens (and step logits) for each prompt: generate() for
    YaRN; a token at a time for dynamic NTK, whose generate() agrees within the original context."""
    refs = {}
    for case, spec in CASES.items():
        hf = hf_model(tiny_dir(**spec))
        with torch.no_grad():
            if case in LENGTH_DEPENDENT:
                refs[case] = [hf_incremental(hf, p, 20)[1:] for p in prompts()]
                short = prompts()[1]   # 15 tokens: generate()'s prefill is inside the original context
                assert hf_greedy(hf, short, 20)[0] == refs[case][1][0]
            else:
                refs[case] = [hf_greedy(hf, p, 20) for p in prompts()]
    return refs


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_chunked_and_prefix_cached(tiny_dir, greedy_references, case):
    greedy_equal_colocated(tiny_dir(**CASES[case]), prompts(), greedy_references[case], 20, MAX_MODEL_LEN)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_disaggregated(tiny_dir, greedy_references, case):
    greedy_equal_disaggregated(tiny_dir(**CASES[case]), prompts(), greedy_references[case], 20, MAX_MODEL_LEN)


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_decoding_and_prompt_logprobs_equal_transformers(tiny_dir, greedy_references, case):
    path = tiny_dir(**CASES[case])
    hf = hf_model(path)
    with torch.no_grad():
        logits = [hf_incremental(hf, p)[0] if case in LENGTH_DEPENDENT else hf(torch.tensor([p])).logits[0]
                  for p in prompts()]
    speculation_and_prompt_logprobs_equal(path, prompts(), greedy_references[case], logits, 20, MAX_MODEL_LEN)


def test_context_limits_of_scaled_ropes(tiny_dir):
    """YaRN and dynamic NTK may serve the original context times the factor, no more."""
    dynamic = str(tiny_dir(**CASES["dynamic-llama"]))
    assert load_model(ModelConfig(model=dynamic, dtype="float32")).model.rotary.cos.shape[0] == ORIGINAL
    with pytest.raises(ConfigError, match=r"max_model_len=65 is not allowed: at most the model's dynamic rope's "
                                          r"original context times its factor \(64\)"):
        load_model(ModelConfig(model=dynamic, dtype="float32", max_model_len=65))


def test_rope_parameters_resolved_and_checked():
    from duoserve.model.rope_params import rope_from_hf

    rope = rope_from_hf({"rope_parameters": YARN_QWEN2, "max_position_embeddings": 512})
    assert (rope.beta_fast, rope.beta_slow, rope.factor) == (8.0, 2.0, 8.0)
    assert rope.attention_factor == pytest.approx((0.1 * 1.0 * torch.log(torch.tensor(8.0)).item() + 1)
                                                  / (0.1 * 0.5 * torch.log(torch.tensor(8.0)).item() + 1))
    with pytest.raises(ConfigError, match="original_max_position_embeddings=None is not allowed"):
        rope_from_hf({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not allowed: 1.0"):
        rope_from_hf({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})


@pytest.mark.parametrize("case", ["yarn-llama", "yarn-qwen2"])
def test_gguf_yarn_keys_give_the_checkpoints_rope(tiny_dir, tmp_path, case):
    """A GGUF file carrying YaRN in llama.cpp's keys (type, factor, original context, the ramp's ends,
    the attention factor): the checkpoint's rope, and transformers' logits on the checkpoint."""
    from tests.model.test_gguf import write_gguf

    path = tiny_dir(**CASES[case])
    out = tmp_path / "yarn.gguf"
    write_gguf(path, out, "F32")
    loaded = load_model(ModelConfig(model=str(out), dtype="float32"))
    checkpoint = load_model(ModelConfig(model=str(path), dtype="float32"))
    assert loaded.arch.rope.rope_type == "yarn"
    assert loaded.arch.rope == dataclasses.replace(checkpoint.arch.rope, attention_factor=pytest.approx(
        checkpoint.arch.rope.attention_factor, rel=1e-6))
    prompt = prompts()[-1]
    with torch.no_grad():
        want = hf_model(path)(torch.tensor([prompt])).logits[0]
    assert (forward_one(loaded.model, prompt) - want).abs().max().item() < 1e-4


def test_gguf_rope_scalings_not_computed_are_refused_by_key(tiny_dir, tmp_path):
    """DeepSeek's YaRN multiplier is not computed: a file carrying it is refused, naming the key."""
    from tests.model.test_gguf import write_gguf

    out = tmp_path / "deepseek-yarn.gguf"
    write_gguf(tiny_dir(**CASES["yarn-llama"]), out, "F32",
               tokenizer=lambda writer: writer.add_float32("llama.rope.scaling.yarn_log_multiplier", 0.5))
    with pytest.raises(ConfigError, match=r"llama\.rope\.scaling\.yarn_log_multiplier=0\.5 is not allowed"):
        load_model(ModelConfig(model=str(out), dtype="float32"))


def test_fingerprint_covers_the_rope_scaling(tiny_dir):
    """Engines whose YaRN ramps differ compute different KV: their fingerprints say where."""
    from duoserve.model.fingerprint import describe, describe_difference

    a = load_model(ModelConfig(model=str(tiny_dir(**CASES["yarn-llama"])), dtype="float32"))
    b = load_model(ModelConfig(model=str(tiny_dir(kind="llama", rope_parameters={**YARN, "beta_fast": 16.0})),
                               dtype="float32"))
    difference = describe_difference("prefill", describe(a.arch, None, a.path), "decode", describe(b.arch, None, b.path))
    assert difference.startswith("rope: prefill={") and "'beta_fast': 32.0" in difference and "'beta_fast': 16.0" in difference
    assert ";" not in difference, "the rope is the only difference"
