"""The default configuration (the packaged GGUF file computed from its blocks, in either dtype)
keeps every equality the engine promises, token for token: a prompt's greedy output is the
same alone or batched, chunked, behind a cached prefix, preempted and recomputed, or verified
by n-gram speculation. Strict equality, no near-tie allowance: the kernels compute a row the
same way whatever its step holds (``tests/kernels/test_quantized.py``)."""

from __future__ import annotations

import pytest

from duoserve import LLM, SamplingParams
from tests.helpers import assert_pool_whole

SYSTEM = ("You are a careful assistant. Answer in plain English, in full sentences, and say so when "
          "you do not know. Keep every answer short. ")
PROMPTS = [SYSTEM + "Question: why is the sky blue? Answer:",
           SYSTEM + "Question: what is the capital of France, and what river runs through it? Answer:",
           "The history of the printing press begins in 1440, when Johannes Gutenberg",
           SYSTEM + "Repeat after me: one two three, one two three, one two three. Answer:",
           "def fibonacci(n):\n    "]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_pool_whole(llm)
    return out


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    """Both activation dtypes (``--dtype auto`` is one of them on every CPU)."""
    return request.param


@pytest.fixture(scope="module")
def alone(dtype) -> list[list[int]]:
    """Each prompt on its own in one step, no prefix cache: the reference."""
    llm = LLM(dtype=dtype, kv_cache_memory=0.1, max_model_len=512, enable_prefix_caching=False)
    assert llm.engine.loaded.quantization == "gguf-fast", "the default computes from the blocks, fast mode"
    return [tokens(llm, [p])[0] for p in PROMPTS]


def test_batched_chunked_and_prefix_cached_equal_alone(alone, dtype):
    llm = LLM(dtype=dtype, kv_cache_memory=0.1, max_model_len=512, max_num_batched_tokens=24)    # prompts cut into chunks of <= 24 tokens
    assert tokens(llm, PROMPTS) == alone
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)        # the prompts' blocks now come from the cache
    assert [o.outputs[0].token_ids for o in again] == alone
    assert sum(o.num_cached_tokens for o in again) >= 16 * len(PROMPTS)
    assert_pool_whole(llm)


def test_preempted_and_recomputed_equals_alone(alone, dtype):
    # 12 blocks of 16 tokens (46 KB a token in float32, 23 in bfloat16): the batch does not fit
    per_token = 30 * 2 * 3 * 64 * (4 if dtype == "float32" else 2)
    llm = LLM(dtype=dtype, kv_cache_memory=12 * 16 * per_token / 2**30, max_model_len=160, max_num_batched_tokens=64)
    assert llm.engine.num_blocks == 12
    assert tokens(llm, PROMPTS) == alone
    assert llm.engine.scheduler.num_preemptions > 0


def test_ngram_speculation_equals_alone(alone, dtype):
    llm = LLM(dtype=dtype, kv_cache_memory=0.1, max_model_len=512, speculative_config=dict(method="ngram", ngram_min=1, disable_batch_size=64))
    assert tokens(llm, PROMPTS) == alone
    assert llm.engine.speculation.num_accepted_tokens > 0   # verification steps of several rows ran
