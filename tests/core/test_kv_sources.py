"""The KV sources the scheduler asks at admission: the prefix cache, the shared KV store, the swap
space and a transfer from a prefill engine. Exact block ids; the pools whole at the end."""

from __future__ import annotations

import pytest

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import KVHit, PrefixCacheSource, SwapSource, TransferSource
from duoserve.core.outputs import RunnerOutput, SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.core.swap_space import SwapCost, SwapSpace
from duoserve.kv.store import StoreSource
from duoserve.sampling_params import SamplingParams

S = RequestStatus
BLOCK = 4


def request(rid: str, prompt: list[int], max_tokens: int = 3, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), (2,))


def scheduler(kv: KVCacheManager, *sources, swap: SwapSource | None = None, budget: int = 32) -> Scheduler:
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=8, sources=sources, swap=swap))


def step(s: Scheduler) -> tuple[SchedulerOutput, list]:
    plan = s.schedule()
    sampled = {x.request.request_id: [7] * x.num_samples for x in plan.scheduled if x.sample}
    return plan, s.update(plan, RunnerOutput(sampled=sampled))


def finish_all(s: Scheduler) -> None:
    """Abort what is left and check that every block came back."""
    for rid in list(s.requests):
        s.abort(rid)
        s.forget(rid)
    assert not s.num_unfinished and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks, "KV blocks leaked"
    if s.swap is not None:
        s.swap.space.end_step()
        assert s.swap.space.is_whole, "swap blocks leaked"


class Recording:
    """A source that holds nothing and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def find(self, request: Request, num_found: int) -> KVHit | None:
        self.asked.append((request.request_id, num_found))
        return None

    def fill(self, request, hit, block_ids, plan) -> None:
        raise AssertionError("never filled: it found nothing")


class FakeStore:
    """The parts of ``BlockStore`` a ``StoreSource`` reads: each fetch returns ``blocks``."""

    def __init__(self, blocks: list) -> None:
        self.blocks, self.asked = blocks, []

    def fetch_prefix(self, request: Request, first_block: int, block_size: int) -> list:
        self.asked.append((request.request_id, first_block, block_size))
        return self.blocks


PROMPT = list(range(100, 110))   # 10 tokens: two full blocks and a partial one


def test_prefix_cache_shares_the_cached_blocks_that_start_a_prompt():
    kv = KVCacheManager(16, BLOCK)
    source = PrefixCacheSource(kv)
    s = scheduler(kv, source, recording := Recording())
    s.add_request(request("a", PROMPT))
    step(s)                                                    # publishes blocks 0 and 1
    b = request("b", PROMPT[:8] + [500, 501, 502])
    hit = source.find(b, 0)
    assert (hit.num_tokens, [x.block_id for x in hit.shared_blocks], hit.cached) == (8, [0, 1], True)
    assert source.find(b, 4) is None                           # only a first hit may share blocks
    assert source.find(request("c", [900] * 10), 0) is None
    assert source.find(request("d", PROMPT, prompt_logprobs=0), 0) is None   # every position is scored
    s.add_request(b)
    plan, _ = step(s)
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.block_ids) for x in plan.scheduled] == \
        [("a", 10, 1, [0, 1, 2]), ("b", 8, 3, [0, 1, 3])]
    assert b.num_cached_tokens == 8 and recording.asked == [("a", 0), ("b", 8)]   # once per admission
    finish_all(s)


def test_the_store_continues_the_prefix_cache_into_new_blocks():
    kv = KVCacheManager(16, BLOCK)
    store = FakeStore(["kv of block 2"])
    s = scheduler(kv, PrefixCacheSource(kv), StoreSource([store], kv))
    assert kv.record_published                                 # what is computed is written to the store
    s.add_request(request("a", PROMPT))
    step(s)
    kv.drain_published()
    b = request("b", PROMPT[:8] + list(range(600, 609)))        # 17 tokens: 2 cached, 1 stored, 5 to compute
    s.add_request(b)
    plan, _ = step(s)
    assert store.asked == [("a", 0, BLOCK), ("b", 2, BLOCK)]
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.block_ids) for x in plan.scheduled] == \
        [("a", 10, 1, [0, 1, 2]), ("b", 12, 5, [0, 1, 3, 4, 5])]
    assert plan.block_loads == [(3, "kv of block 2")]
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 17   # the step computed the other 5
    finish_all(s)


def test_the_store_skips_requests_that_take_no_cached_kv():
    kv = KVCacheManager(16, BLOCK)
    store = FakeStore(["kv"])
    source = StoreSource([store], kv)
    assert source.find(request("a", PROMPT, prompt_logprobs=0), 0) is None
    running = request("b", PROMPT)
    running.status = S.RUNNING
    assert source.find(running, 0) is None and store.asked == []
    assert source.find(request("c", PROMPT), 0) == KVHit(BLOCK, payload=["kv"], cached=True)


def swapping_scheduler() -> Scheduler:
    kv = KVCacheManager(4, BLOCK)
    swap = SwapSource(SwapSpace(8), SwapCost(block_bytes=1))   # copies cost nothing: always swap
    return scheduler(kv, PrefixCacheSource(kv), swap, swap=swap, budget=16)


def test_the_swap_space_takes_a_preempted_request_out_and_back_in():
    s = swapping_scheduler()
    a, b = request("a", list(range(100, 107))), request("b", list(range(200, 207)), max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)                                                    # 8 tokens each: all four blocks full
    plan, _ = step(s)                                          # a needs a third block: b goes out
    assert plan.preempted_ids == ["b"] and plan.swap_out == [(2, 0), (3, 1)]
    assert b.status is S.SWAPPED and b.swap_block_ids == [0, 1] and b.num_computed_tokens == 8
    assert [(x.request.request_id, x.block_ids) for x in plan.scheduled] == [("a", [0, 1, 3])]
    assert a.is_finished
    hit = s.swap.find(b, 0)
    assert hit == KVHit(0) and s.swap.find(a, 0) is None       # its computed tokens stay counted
    plan, _ = step(s)
    assert plan.swap_in == [(0, 2), (1, 3)]
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.block_ids) for x in plan.scheduled] == \
        [("b", 8, 1, [2, 3, 1])]
    assert b.status is S.RUNNING and b.swap_block_ids == [] and s.swap.space.num_free_blocks == 6
    s.schedule()                                               # the next step: released swap blocks free
    assert s.swap.space.num_free_blocks == 8
    finish_all(s)


def test_swap_out_declines_when_recomputing_is_cheaper_or_the_space_is_full():
    expensive = SwapSource(SwapSpace(8), SwapCost(block_bytes=1, copy_bytes_per_s=1e-9))
    full = SwapSource(SwapSpace(1), SwapCost(block_bytes=1))
    r = request("a", list(range(8)))
    r.num_computed_tokens = 8
    assert expensive.swap_out(r, [5, 6], 2) is None and full.swap_out(r, [5, 6], 2) is None
    assert r.swap_block_ids == [] and full.space.is_whole and expensive.space.is_whole


def test_a_swap_space_must_be_one_of_the_sources():
    kv = KVCacheManager(4, BLOCK)
    swap = SwapSource(SwapSpace(8), SwapCost(block_bytes=1))
    with pytest.raises(ValueError, match="the swap space must also be one of the sources"):
        scheduler(kv, PrefixCacheSource(kv), swap=swap)


def test_a_transfer_provides_the_whole_prompt_and_is_written_once():
    kv = KVCacheManager(16, BLOCK)
    source = TransferSource()
    s = scheduler(kv, PrefixCacheSource(kv), source)
    a = request("a", PROMPT)
    assert source.find(a, 0) is None                           # a prompt of this engine's own
    a.output_token_ids.append(9)
    a.prompt_logprobs = None
    s.add_transferred(a, "the KV")
    assert source.find(a, 0) == KVHit(10)
    plan, _ = step(s)
    assert plan.kv_inserts == [("a", [0, 1, 2], "the KV")] and a.transferred_kv is None
    assert [(x.start, x.num_new_tokens) for x in plan.scheduled] == [(10, 1)]
    assert step(s)[0].kv_inserts == []
    finish_all(s)
