"""A model whose every layer is windowed (Mistral-style) gives its blocks back as decoding passes
the window, and still computes transformers' tokens; a mixed one (Gemma) says why it cannot."""

from __future__ import annotations

import random

import torch

from duoserve import LLM, SamplingParams
from duoserve.config import CacheConfig, EngineConfig, KVStoreConfig, ModelConfig, SchedulerConfig
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.request import Request
from duoserve.engine.builder import build_engine
from tests.helpers import assert_pool_whole, assert_same_greedy, hf_greedy, hf_model, wait_for_store_writes
from tests.model.family_checks import greedy_equal_disaggregated, speculation_and_prompt_logprobs_equal

WINDOW = 16
MISTRAL = dict(kind="mistral", sliding_window=WINDOW)


def prompt_of(n: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed + n)
    return [rng.randrange(256) for _ in range(n)]


def test_decoding_four_windows_holds_a_windows_blocks_and_equals_transformers(tiny_dir):
    """10 prompt tokens and 64 decoded (4x the window of 16), blocks of 4: the request never holds
    more than 16 / 4 + 1 blocks (where it would reach 19 without the window), the blocks freed are
    exactly those wholly before each step's window, and the tokens are transformers'."""
    path = tiny_dir(**MISTRAL)
    engine = build_engine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", max_model_len=256),
                                       cache=CacheConfig(block_size=4, kv_cache_memory=0.01)))
    assert engine.memory["kv_pool"]["window_freeing"].startswith("on: blocks wholly before a sequence's last 16")
    prompt, params = prompt_of(10), SamplingParams(temperature=0.0, max_tokens=4 * WINDOW, ignore_eos=True)
    engine.add_request(Request("w", prompt, params, (), 256))
    pool, tokens, most_used = engine.kv.pool, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.position:] = out.new_token_ids
        if engine.has_unfinished():   # a finished request has given everything back
            most_used = max(most_used, pool.num_blocks - pool.num_free_blocks)
    engine.release("w")
    assert most_used == WINDOW // 4 + 1
    # the last token computed is at p = 72, whose window starts at 57: blocks 0 ... 13 (up to 55) freed
    assert engine.kv.num_window_freed == 14
    with torch.no_grad():
        want, scores = hf_greedy(hf_model(path), prompt, 4 * WINDOW)
    assert_same_greedy(tokens, want, scores, "windowed mistral, 4 windows")
    assert_pool_whole(engine)


def test_chunked_prefix_cached_and_a_tight_pool_equal_transformers(tiny_dir):
    """Prompts longer than the window, chunked by 16 tokens, each run twice (the second time from the
    prefix cache, blocks the window freed included) in a pool of 52 blocks of 4 that reuses freed
    blocks for other requests: transformers' tokens every time."""
    path = tiny_dir(**MISTRAL)
    prompts = [prompt_of(n) for n in (5, 23, 40, 70)]
    with torch.no_grad():
        ref = hf_model(path)
        want = [hf_greedy(ref, prompt, 40) for prompt in prompts]
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=0.0001, max_num_batched_tokens=16,
              max_model_len=128)
    assert llm.engine.num_blocks == 52
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for attempt in ("computed", "prefix-cached"):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out, (tokens, scores) in zip(prompts, outs, want):
            assert_same_greedy(out.outputs[0].token_ids, tokens, scores, f"{attempt}, prompt of {len(prompt)}")
    assert llm.engine.kv.num_hits > 0 and llm.engine.kv.num_window_freed > 100
    assert llm.engine.kv.pool.num_evictions > 0   # freed blocks were handed to others
    assert_pool_whole(llm)


def spy_on_frees(monkeypatch) -> list[int]:
    """The ids of every block the window frees from now on, in any engine of this process."""
    freed: list[int] = []
    original = KVCacheManager.free_outside_window

    def counting(self, request):
        ids = original(self, request)
        freed.extend(ids)
        return ids

    monkeypatch.setattr(KVCacheManager, "free_outside_window", counting)
    return freed


def test_the_decode_engine_frees_what_the_prefill_engine_handed_over(tiny_dir, monkeypatch):
    """Disaggregated: the prefill engine keeps the prompt whole (it hands all of it over), the decode
    engine (blocks of 32) frees behind the window; transformers' tokens."""
    freed = spy_on_frees(monkeypatch)
    path = tiny_dir(**MISTRAL)
    prompts = [prompt_of(n) for n in (9, 40)]
    with torch.no_grad():
        ref = hf_model(path)
        want = [hf_greedy(ref, prompt, 48) for prompt in prompts]
    greedy_equal_disaggregated(path, prompts, want, 48, 128)
    assert len(freed) >= 2   # the decode engine's blocks of 32: the 40-token prompt passes p = 47 and 79


def test_ngram_speculation_and_prompt_logprobs_with_the_window_freeing(tiny_dir, monkeypatch):
    """Guesses verified past the window (their positions all after the next token's) and prompt
    log-probabilities (every prompt position run, whatever is freed): transformers' tokens and
    log-softmax."""
    freed = spy_on_frees(monkeypatch)
    path = tiny_dir(**MISTRAL)
    prompts = [prompt_of(n) for n in (9, 40)]
    with torch.no_grad():
        ref = hf_model(path)
        want = [hf_greedy(ref, prompt, 48) for prompt in prompts]
        logits = [ref(torch.tensor([prompt])).logits[0] for prompt in prompts]
    speculation_and_prompt_logprobs_equal(path, prompts, want, logits, 48, 128)
    assert len(freed) >= 4   # blocks of 16: p = 31, 47, 63, 79 pass blocks 0 ... 3 of the longer one


def test_the_store_holds_the_blocks_a_windowed_engine_freed(tiny_dir, redis_server):
    """Every full block goes to the shared KV store after the step that computed it, before the window
    frees it: a second engine takes the prompt's 17 full blocks from the store, computes only the
    last 2 tokens, and both give transformers' tokens."""
    path = tiny_dir(**MISTRAL)
    prompt, params = prompt_of(70), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with torch.no_grad():
        want, scores = hf_greedy(hf_model(path), prompt, 40)

    def engine() -> LLM:
        return LLM.from_engine(build_engine(EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32", max_model_len=128),
            cache=CacheConfig(block_size=4, kv_cache_memory=0.01), scheduler=SchedulerConfig(max_num_batched_tokens=16),
            kv_store=KVStoreConfig(redis_server.url))))

    first = engine()
    (out,) = first.generate([prompt], params, use_tqdm=False)
    assert_same_greedy(out.outputs[0].token_ids, want, scores, "computed, written to the store")
    wait_for_store_writes(first.engine)
    assert first.engine.kv.num_window_freed > 15
    second = engine()
    (again,) = second.generate([prompt], params, use_tqdm=False)
    assert_same_greedy(again.outputs[0].token_ids, want, scores, "from the store")
    assert second.engine.kv_store.stats()["kv_store_hits"] == 17 and second.engine.measures.num_prompt_tokens == 2
    for llm in (first, second):
        llm.engine.close()
        assert_pool_whole(llm)


def test_a_mixed_model_says_why_its_blocks_stay(tiny_dir):
    """Gemma 3 (a local layer, then a global one): one block table for every layer, so nothing is
    freed, and the memory report says so; the engine frees nothing while it decodes past the window."""
    llm = LLM(str(tiny_dir(kind="gemma3")), dtype="float32", kv_cache_memory=0.01)
    why = llm.engine.memory["kv_pool"]["window_freeing"]
    assert why.startswith("off: 1 of 2 layers attend over the whole context and every layer shares one block table")
    llm.generate([prompt_of(20)], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.engine.kv.num_window_freed == 0
    assert_pool_whole(llm)


def test_a_prefill_engine_keeps_the_whole_prompt(tiny_dir):
    """It hands the whole prompt's KV over: nothing of it may be freed there."""
    engine = build_engine(EngineConfig(model=ModelConfig(model=str(tiny_dir(**MISTRAL)), dtype="float32"),
                                       cache=CacheConfig(kv_cache_memory=0.01), role="prefill",
                                       scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    assert engine.kv.sliding_window is None
    assert engine.memory["kv_pool"]["window_freeing"].startswith("off on a prefill engine")


def test_the_dry_run_says_whether_windows_free(tiny_dir):
    """--dry-run's plan (no model loaded) has the same line, for a model that has a window."""
    from duoserve.worker.memory import describe_plan, plan

    def windows_line(path, **model) -> list[str]:
        result = plan(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", **model),
                                   cache=CacheConfig(kv_cache_memory=0.01)))
        return [line for line in describe_plan(result).splitlines() if line.startswith("windows ")]

    assert windows_line(tiny_dir(**MISTRAL)) == [
        "windows        on: blocks wholly before a sequence's last 16 tokens go back to the pool as it decodes"]
    assert windows_line(tiny_dir(kind="gemma3"))[0].startswith("windows        off: 1 of 2 layers attend")
    assert windows_line(tiny_dir(**MISTRAL), max_model_len=16) == []   # a window as long as the context is none
    assert windows_line(tiny_dir(kind="llama")) == []
