"""Checks shared by the tests of a model family or rope type against transformers: its reference
computed token by token, and the engine's greedy tokens colocated (chunked, prefix-cached) and
disaggregated (a prefill and a decode engine joined in process)."""

from __future__ import annotations

from pathlib import Path

import torch

from duoserve import LLM, SamplingParams
from duoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from duoserve.core.request import Request
from duoserve.engine.builder import build_engine
from tests.disagg_helpers import joined_in_process
from tests.helpers import assert_pool_whole, assert_same_greedy


def hf_incremental(model, prompt: list[int], max_new_tokens: int = 1) -> tuple[torch.Tensor, list[int], list]:
    """transformers fed one token a forward, its KV cached: the logits at every prompt position
    [n, vocab], then its greedy continuation and each step's logits. (Fed so, a rope that depends
    on the sequence's length, dynamic NTK or longrope, sees p + 1 at position p.)"""
    cache, rows, sequence = None, [], list(prompt)
    for position in range(len(prompt) + max_new_tokens - 1):
        with torch.no_grad():
            out = model(torch.tensor([[sequence[position]]]), position_ids=torch.tensor([[position]]),
                        cache=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1])
        if position + 1 >= len(prompt):
            sequence.append(int(rows[-1].argmax()))
    steps = rows[len(prompt) - 1:]
    return torch.stack(rows[:len(prompt)]), sequence[len(prompt):], steps


def greedy_equal_colocated(path: Path, prompts: list[list[int]], want: list[tuple[list[int], list]],
                           max_new_tokens: int, max_model_len: int, expect_hits: bool = True) -> None:
    """Colocated, prompts chunked by a budget of 16 tokens, each prompt run twice (the second time
    from the prefix cache, where a prompt fills a block of 16): transformers' greedy tokens every time."""
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=16,
              max_model_len=max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    for attempt in ("computed", "prefix-cached"):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out, (tokens, scores) in zip(prompts, outs, want):
            assert_same_greedy(out.outputs[0].token_ids, tokens, scores, f"{attempt}, prompt of {len(prompt)}")
    assert llm.engine.kv.num_hits > 0 or not expect_hits, "the second run must hit the prefix cache"
    assert_pool_whole(llm)


def greedy_equal_disaggregated(path: Path, prompts: list[list[int]], want: list[tuple[list[int], list]],
                               max_new_tokens: int, max_model_len: int) -> None:
    """A prefill engine (blocks of 16) handing each prompt's KV to a decode engine (blocks of 32):
    transformers' greedy tokens."""
    def engine(role: str, block_size: int):
        return build_engine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32",
                                                           max_model_len=max_model_len),
                                         cache=CacheConfig(block_size=block_size, kv_cache_memory=0.01),
                                         scheduler=SchedulerConfig(max_num_batched_tokens=16), role=role))
    prefill, decode = joined_in_process(engine("prefill", 16), engine("decode", 32))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished: set[str] = set()
    for i, prompt in enumerate(prompts):
        prefill.add_request(Request(f"r{i}", prompt, params, (), max_model_len))
    for _ in range(2000):
        for engine_core in (prefill, decode):
            for out in engine_core.step():
                tokens[out.request_id][out.position:] = out.new_token_ids
                if out.finished:   # as the frontend does once it has the last output
                    finished.add(out.request_id)
                    engine_core.release(out.request_id)
        if len(finished) == len(prompts) and not (prefill.scheduler.requests or decode.scheduler.requests):
            break   # finished, and the prefill engine has had every acknowledgement
    assert len(finished) == len(prompts), f"unfinished: {set(tokens) - finished}"
    assert prefill.handoff.num_transfer_bytes > 0
    for i, (prompt, (want_tokens, scores)) in enumerate(zip(prompts, want)):
        assert_same_greedy(tokens[f"r{i}"], want_tokens, scores, f"disaggregated, prompt of {len(prompt)}")
    for engine_core in (prefill, decode):
        assert_pool_whole(engine_core)


def speculation_and_prompt_logprobs_equal(path: Path, prompts: list[list[int]], want: list[tuple[list[int], list]],
                                          reference_logits: list[torch.Tensor], max_new_tokens: int,
                                          max_model_len: int) -> None:
    """With n-gram speculation (guesses from the sequence's own tokens, verified by the target) the
    greedy tokens are transformers'; the prompt log-probabilities are transformers' log-softmax at
    every prompt position (within 1e-4), ``reference_logits`` [n, vocab] per prompt."""
    spec = dict(method="ngram", ngram_min=1, num_speculative_tokens=3, disable_batch_size=64)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=max_model_len, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.speculation.num_accepted_tokens > 0
    for prompt, out, (tokens, scores), logits in zip(prompts, outs, want, reference_logits):
        assert_same_greedy(out.outputs[0].token_ids, tokens, scores, f"speculative, prompt of {len(prompt)}")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        got = [entry.logprob for entry in out.prompt_logprobs[1:]]
        expected = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4
    assert_pool_whole(llm)
