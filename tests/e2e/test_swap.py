"""Swap space: preempted requests' KV copied out and back in gives the tokens of an unconstrained
run; a full swap space falls back to recompute; both pools are whole after every run."""

from __future__ import annotations

import pytest

from duoserve import LLM, SamplingParams
from duoserve.core.request import Request, RequestStatus
from duoserve.core.swap_space import SwapCost, SwapSpace
from duoserve.errors import InvalidRequestError
from tests.helpers import assert_pool_whole
from tests.e2e.test_engine_equivalence import prompts_with_shared_prefixes

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
# 40 blocks of 4 tokens (512 bytes a token): one full-length sequence fits, the batch does not
TIGHT = dict(dtype="float32", kv_cache_memory=40 * 4 * 512 / 2**30, max_model_len=128, block_size=4,
             max_num_batched_tokens=32)
BLOCK_BYTES = 4 * 512


def run(path, prompts, params, **kwargs):
    llm = LLM(str(path), **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_whole(llm)
    swap = llm.engine.scheduler.swap
    assert swap is None or swap.space.is_whole, "swap blocks leaked"
    return llm, [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    path = tiny_dir(kind="llama")
    _, want = run(path, prompts_with_shared_prefixes(), GREEDY, dtype="float32", kv_cache_memory=0.01, max_model_len=128)
    return path, want


def test_swapping_under_heavy_preemption_gives_the_unconstrained_tokens(reference):
    path, want = reference
    llm, got = run(path, prompts_with_shared_prefixes(), GREEDY, swap_space=64 * BLOCK_BYTES / 2**30, **TIGHT)
    assert got == want
    scheduler = llm.engine.scheduler
    assert scheduler.num_swap_preemptions > 0, "decoding requests should have been swapped out"
    assert scheduler.num_preemptions >= scheduler.num_swap_preemptions
    assert llm.engine.runner.swap_bytes > 0


def test_a_full_swap_space_falls_back_to_recompute(reference):
    path, want = reference
    llm, got = run(path, prompts_with_shared_prefixes(), GREEDY, swap_space=3 * BLOCK_BYTES / 2**30, **TIGHT)
    assert got == want
    assert llm.engine.num_swap_blocks == 3
    assert llm.engine.scheduler.num_preemptions > 0


def test_n_2_samples_swap_alike(tiny_dir):
    path = tiny_dir(kind="llama")
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
    prompts = prompts_with_shared_prefixes()[:5]
    _, want = run(path, prompts, params, dtype="float32", kv_cache_memory=0.01, max_model_len=128)
    llm, got = run(path, prompts, params, swap_space=64 * BLOCK_BYTES / 2**30, **TIGHT)
    assert got == want
    assert llm.engine.scheduler.num_swap_preemptions > 0


def test_recompute_is_chosen_when_it_is_cheaper(reference):
    cost = SwapCost(block_bytes=1 << 20, copy_bytes_per_s=1e9, prefill_tokens_per_s=1000.0)
    assert cost.prefers_swap(num_blocks=4, num_tokens=64)        # 8 ms of copies vs 64 ms of prefill
    assert not cost.prefers_swap(num_blocks=64, num_tokens=64)   # 134 ms vs 64 ms
    path, want = reference
    llm = LLM(str(path), swap_space=64 * BLOCK_BYTES / 2**30, **TIGHT)
    llm.engine.swap_cost.copy_bytes_per_s = 1.0   # copying looks hopeless, and stays so:
    llm.engine.runner.swap_bytes = 0              # (the engine would re-measure it from real copies)
    outs = llm.generate(prompts_with_shared_prefixes(), GREEDY, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert llm.engine.scheduler.num_swap_preemptions == 0 and llm.engine.scheduler.num_preemptions > 0


def test_swap_space_hands_out_released_blocks_only_after_the_step():
    swap = SwapSpace(4)
    taken = swap.allocate(3)
    assert taken == [0, 1, 2] and swap.allocate(2) is None
    swap.release(taken[:2])
    assert swap.num_free_blocks == 1 and not swap.is_whole   # their copy-in has not run yet
    swap.end_step()
    assert swap.num_free_blocks == 3 and swap.allocate(3) == [0, 1, 3]
    assert swap.usage == 1.0 and swap.allocate(1) is None


def test_only_running_and_swapped_move_between_each_other():
    request = Request("r", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="cannot move from WAITING to SWAPPED"):
        request.move_to(RequestStatus.SWAPPED)
    request.move_to(RequestStatus.PREFILLING)
    request.move_to(RequestStatus.RUNNING)
    request.move_to(RequestStatus.SWAPPED)
    with pytest.raises(InvalidRequestError, match="cannot move from SWAPPED to WAITING"):
        request.move_to(RequestStatus.WAITING)
    request.move_to(RequestStatus.RUNNING)


def test_aborting_a_swapped_request_frees_its_swap_blocks(reference):
    path, _ = reference
    llm = LLM(str(path), swap_space=64 * BLOCK_BYTES / 2**30, **TIGHT)
    ids = [llm.frontend.add_request(p, GREEDY) for p in prompts_with_shared_prefixes()]
    scheduler = llm.engine.scheduler
    for _ in range(500):
        llm.frontend.step()
        if scheduler.swapped:
            break
    assert scheduler.swapped, "a request should be swapped out by now"
    victim = scheduler.swapped[0]
    assert victim.swap_block_ids and scheduler.swap.space.num_free_blocks < 64
    llm.frontend.abort(victim.request_id)
    assert victim.status is RequestStatus.FINISHED_ABORTED and not victim.swap_block_ids
    for request_id in ids:
        llm.frontend.abort(request_id)
    while llm.frontend.has_unfinished():
        llm.frontend.step()
    scheduler.swap.space.end_step()
    assert scheduler.swap.space.is_whole
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks
