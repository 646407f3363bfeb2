"""The default configuration (the packaged GGUF file computed from its blocks, in either dtype)
keeps every equality the engine promises, token for token: a prompt's greedy output is the
same alone or batched, chunked, behind a cached prefix, preempted and recomputed, swapped out
and back, verified by n-gram speculation, as each of n = 2 samples, handed from a prefill
engine to a decode engine with other blocks, or read back from Redis by a fresh engine
(colocated and disaggregated). Streamed vs whole through a server: tests/entrypoints/
test_default_server_equality.py; compiled vs eager: tests/worker/test_compiled.py. Strict equality, no near-tie allowance: the kernels compute a row the
same way whatever its step holds (``tests/kernels/test_gguf.py``)."""

from __future__ import annotations

import pytest

from duoserve import LLM, SamplingParams
from tests.helpers import assert_pool_whole, wait_for_store_writes

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


def test_swapped_out_and_back_equals_alone(alone, dtype):
    per_token = 30 * 2 * 3 * 64 * (4 if dtype == "float32" else 2)
    llm = LLM(dtype=dtype, kv_cache_memory=12 * 16 * per_token / 2**30, max_model_len=160, max_num_batched_tokens=64,
              swap_space=64 * 16 * per_token / 2**30)
    assert tokens(llm, PROMPTS) == alone
    assert llm.engine.scheduler.num_swap_preemptions > 0, "decoding requests should have been swapped out"
    assert llm.engine.scheduler.swap.space.is_whole


def test_n_2_greedy_samples_each_equal_alone(alone, dtype):
    llm = LLM(dtype=dtype, kv_cache_memory=0.1, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[a, a] for a in alone]
    assert_pool_whole(llm)


def disaggregated_pair(dtype: str, kv_store: str | None = None):
    """A prefill and a decode engine on the default model, joined in process; the decode side
    keeps blocks of 32 tokens, so every handed-over prompt is re-blocked."""
    from duoserve.config import CacheConfig, DisaggConfig, EngineConfig, KVStoreConfig, ModelConfig
    from duoserve.engine.builder import build_engine
    from tests.disagg_helpers import joined_in_process

    base = EngineConfig(model=ModelConfig(dtype=dtype, max_model_len=512), cache=CacheConfig(block_size=32, kv_cache_memory=0.1),
                        kv_store=KVStoreConfig(kv_store) if kv_store else None)
    prefill_config, decode_config = DisaggConfig(prefill_block_size=16).engine_configs(base)
    return joined_in_process(build_engine(prefill_config), build_engine(decode_config))


def test_disaggregated_equals_alone(alone, dtype):
    from tests.e2e.test_disagg_inprocess import pool_whole, run

    prefill, decode = disaggregated_pair(dtype)
    ids = [prefill.tokenizer.encode(p) for p in PROMPTS]
    for round_ in range(2):                  # the second round reads the prompts' blocks from the prefill cache
        got, finished = run(prefill, decode, ids, GREEDY)
        assert got == alone, f"round {round_}"
        assert set(finished.values()) == {"length"}
        assert pool_whole(prefill) and pool_whole(decode)
        for engine in (prefill, decode):          # as the frontend does once it has the last outputs
            for i in range(len(ids)):
                engine.release(f"r{i}")
    assert prefill.kv.num_hits > 0


def test_blocks_read_from_redis_equal_alone_colocated_and_disaggregated(alone, dtype, redis_server):
    from tests.e2e.test_disagg_inprocess import pool_whole, run

    first = LLM(dtype=dtype, kv_cache_memory=0.1, max_model_len=512, kv_store=redis_server.url)
    assert tokens(first, PROMPTS) == alone
    wait_for_store_writes(first.engine, timeout=10)
    fresh = LLM(dtype=dtype, kv_cache_memory=0.1, max_model_len=512, kv_store=redis_server.url)
    outs = fresh.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_whole(fresh)
    # every full block of every prompt came from a cache (the store, or the fresh engine's own
    # for the shared system prompt once read); the last prompt token is always computed
    full = [(len(fresh.engine.tokenizer.encode(p)) - 1) // 16 * 16 for p in PROMPTS]
    assert [o.num_cached_tokens for o in outs] == full
    assert fresh.engine.kv_store.stats()["kv_store_hits"] > 0
    prefill, decode = disaggregated_pair(dtype, redis_server.url)
    got, _ = run(prefill, decode, [prefill.tokenizer.encode(p) for p in PROMPTS], GREEDY)
    assert got == alone
    assert prefill.kv_store.stats()["kv_store_hits"] > 0
    assert pool_whole(prefill) and pool_whole(decode)
    wait_for_store_writes(fresh.engine, prefill, decode, timeout=10)
