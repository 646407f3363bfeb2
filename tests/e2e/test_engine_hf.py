"""Greedy generation through the whole engine equals transformers' generate."""

from __future__ import annotations

import random

import pytest
import torch

from duoserve import LLM, SamplingParams
from tests.helpers import assert_pool_whole, assert_same_greedy, hf_greedy, hf_model

GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def mixed_prompts(vocab: int, lengths=(1, 5, 17, 33, 64, 9, 100)) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3", "gemma2", "mistral-window",
                                  "mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_batch_matches_transformers(tiny_dir, kind):
    """gemma3, gemma2 and mistral-window: windows of 8, shorter than most prompts and every continuation.
    Every family's decode steps run in the C++ decode step where its packed weights can be read."""
    from duoserve.kernels.dense import packed_linear_supported

    path = tiny_dir(kind="mistral", sliding_window=8) if kind == "mistral-window" else tiny_dir(kind=kind)
    prompts = mixed_prompts(256)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
    assert (llm.engine.runner.forward.fused is not None) == packed_linear_supported(torch.float32)
    outs = llm.generate(prompts, GREEDY32, use_tqdm=False)
    ref = hf_model(path)
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            want, scores = hf_greedy(ref, prompt, 32)
            assert out.prompt_token_ids == prompt
            assert out.outputs[0].finish_reason == "length"
            assert_same_greedy(out.outputs[0].token_ids, want, scores, f"{kind} prompt of {len(prompt)}")
    assert_pool_whole(llm)


PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):",
    "In 1492, Christopher Columbus",
    "A haiku about autumn:\n",
]


def test_default_model_greedy_matches_transformers(smol_llm, hf_default_model):
    hf_tokenizer, hf = hf_default_model
    outs = smol_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outs):
            ids = hf_tokenizer(prompt)["input_ids"]
            assert out.prompt_token_ids == ids
            want, scores = hf_greedy(hf, ids, 16)
            assert_same_greedy(out.outputs[0].token_ids, want, scores, prompt)
            assert out.outputs[0].text == hf_tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert_pool_whole(smol_llm)
