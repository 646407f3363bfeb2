"""Sliding windows that free memory: a request's blocks wholly before its window go back to the
pool as it moves on (no torch, no model: the block accounting alone)."""

from __future__ import annotations

import pytest

from duoserve.core.kv_cache_manager import KVCacheManager, window_to_free
from duoserve.core.kv_sources import PrefixCacheSource, SwapSource
from duoserve.core.outputs import RunnerOutput, SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.core.swap_space import SwapCost, SwapSpace
from duoserve.sampling_params import SamplingParams

_MADE: list[Scheduler] = []


@pytest.fixture(autouse=True)
def _pool_whole_after_each_test():
    """Every scheduler a test made ends with no request and every block (and swap block) free."""
    _MADE.clear()
    yield
    for s in _MADE:
        assert not s.num_unfinished, f"requests left: {sorted(s.requests)}"
        assert not s.kv.req_blocks, f"blocks still held by {sorted(s.kv.req_blocks)}"
        assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks, "blocks leaked"
        if s.swap is not None:
            s.swap.space.end_step()
            assert s.swap.space.is_whole, "swap blocks leaked"
    _MADE.clear()


def make(window: int | None = 8, num_blocks: int = 16, budget: int = 16, swap: SwapSource | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, True, window)   # blocks of 4 tokens
    sources = [PrefixCacheSource(kv)] + ([swap] if swap else [])
    s = Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=8, sources=sources, swap=swap))
    _MADE.append(s)
    return s


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), (2,))
    s.add_request(request)
    return request


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    plan = s.schedule()
    s.update(plan, RunnerOutput(sampled={i.request.request_id: [token] * i.num_samples
                                         for i in plan.scheduled if i.sample}))
    return plan


def table(s: Scheduler, rid: str) -> list[int | None]:
    return [None if b is None else b.block_id for b in s.kv.req_blocks[rid]]


def test_blocks_wholly_before_the_window_are_freed_as_decoding_passes_it():
    """Window 8, blocks of 4: the token at position p sees p - 7 ... p, so block k (positions
    4k ... 4k + 3) goes when p reaches 4k + 11, before that step's new block is taken."""
    s = make(window=8)
    a = add(s, "a", list(range(100, 106)), max_tokens=20)   # 6 prompt tokens: blocks 0, 1
    step(s)                                                   # prompt; first token sampled
    assert table(s, "a") == [0, 1] and a.num_computed_tokens == 6
    freed_at = {}
    for _ in range(14):
        before = s.kv.pool.free_queue.block_ids()
        plan = step(s)
        (item,) = plan.scheduled
        now_free = [b for b in s.kv.pool.free_queue.block_ids() if b not in before]
        if now_free:
            freed_at[item.start] = now_free
    # p = 11: block 0 (0..3) passes; p = 15: block 1; p = 19: block 2
    assert freed_at == {11: [0], 15: [1], 19: [2]}
    assert a.num_computed_tokens == 20 and table(s, "a") == [None, None, None, 3, 4]
    # the runner reads a freed slot as the first live block (masked by the window, never written)
    assert s.kv.block_ids("a") == [3, 3, 3, 3, 4]
    while s.num_unfinished:   # 26 tokens: the last computed at p = 24, block 3 freed at p = 23
        step(s)
    assert s.kv.num_window_freed == 4


def test_the_pool_holds_at_most_the_window_while_decoding_four_windows():
    """Decoding 4x the window: the request never holds more than window / block_size + 1 blocks,
    where without the window it holds one block per 4 tokens of its whole sequence."""
    most = {}
    for window in (8, None):
        s = make(window=window, num_blocks=16)
        add(s, "a", list(range(100, 106)), max_tokens=32)
        most[window] = 0
        while s.num_unfinished:   # measured once each step's blocks are taken
            plan = s.schedule()
            most[window] = max(most[window], s.kv.pool.num_blocks - s.kv.pool.num_free_blocks)
            s.update(plan, RunnerOutput(sampled={i.request.request_id: [7] for i in plan.scheduled if i.sample}))
    assert most == {8: 8 // 4 + 1, None: 10}   # 37 of its 38 tokens computed: 10 blocks


def test_a_prompt_longer_than_the_window_frees_between_its_chunks():
    """Chunks of 8 over a 20-token prompt: each chunk starts past the blocks the last one left
    behind; a shared prefix hit later finds the first blocks still cached (free, hashed)."""
    s = make(window=4, budget=8)
    prompt = list(range(200, 220))
    add(s, "a", prompt, max_tokens=1)
    plans = [step(s) for _ in range(3)]
    assert [(p.scheduled[0].start, p.scheduled[0].block_ids) for p in plans] == [
        (0, [0, 1]), (8, [1, 1, 2, 3]), (16, [3, 3, 3, 3, 4])]   # p = 8 frees block 0, p = 16 blocks 1, 2
    assert s.requests["a"].is_finished
    b = add(s, "b", prompt + [1, 2], max_tokens=1)   # the same prompt: its freed blocks are valid KV
    plan = step(s)
    assert b.num_cached_tokens == 20 and plan.scheduled[0].start == 20


def test_n_samples_share_the_prompts_live_blocks_only():
    """A sample forked after a windowed prompt takes the prompt's live full blocks (not the ones
    the window freed) and a copy of the tail; every block comes back when all finish."""
    s = make(window=4, budget=8)
    add(s, "a", list(range(300, 318)), max_tokens=2, n=2)   # 18 tokens: the tail block holds 2
    step(s), step(s)
    plan = step(s)   # the last chunk (16, 17): first tokens sampled, the sample forked
    assert table(s, "a") == [None, None, None, 3, 4] and table(s, "a/1") == [None, None, None, 3, 5]
    assert s.kv.pool.blocks[3].ref_count == 2 and plan.block_copies == [] and s.pending_copies == [(4, 5)]
    while s.num_unfinished:
        step(s)


def test_a_window_freed_request_is_recomputed_not_swapped():
    """Preempted past its window, a request's table lacks the KV a swap copies: it recomputes (its
    recomputation frees again as it goes); one still within its window swaps."""
    swap = SwapSource(SwapSpace(8), SwapCost(block_bytes=1, prefill_tokens_per_s=1.0))  # swapping always pays
    s = make(window=4, num_blocks=8, budget=8, swap=swap)
    a = add(s, "a", list(range(400, 406)), max_tokens=12)
    b = add(s, "b", list(range(500, 502)), max_tokens=12)
    for _ in range(3):
        step(s)
    assert s.kv.has_window_freed(a) and not s.kv.has_window_freed(b)   # a at p = 8, b at p = 4
    for request in (b, a):   # as schedule() preempts when blocks run out: the newest first
        s.running.remove(request)
        s._preempt(request)
    assert b.status is RequestStatus.SWAPPED and b.swap_block_ids == [0] and b.num_computed_tokens == 4
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0 and s.num_swap_preemptions == 1
    while s.num_unfinished:
        step(s)
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_which_models_free_and_why_not():
    assert window_to_free([8, 8], "colocated", False) == (
        8, "on: blocks wholly before a sequence's last 8 tokens go back to the pool as it decodes")
    assert window_to_free([8, 16], "decode", False)[0] == 16
    window, why = window_to_free([8, 8, 8, 8, 8, None], "colocated", False)   # Gemma 3: one global in six
    assert window is None and why.startswith("off: 1 of 6 layers attend over the whole context and every layer "
                                             "shares one block table")
    assert window_to_free([None, None], "colocated", False) == (
        None, "off: no layer has a sliding window shorter than the context")
    assert window_to_free([8, 8], "prefill", False)[1].startswith("off on a prefill engine")
    assert window_to_free([8, 8], "colocated", True)[1].startswith("off with a draft model")
