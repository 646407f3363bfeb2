"""The scheduler's role paths, without a model: colocated, prefill (leases, acks, expiry), decode
(requests whose KV arrived). Exact block ids; the pool whole at the end of every test."""

from __future__ import annotations

import time

import pytest

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import PrefixCacheSource, TransferSource
from duoserve.core.outputs import RunnerOutput, SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.roles import PrefillOnly, RolePolicy
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.sampling_params import SamplingParams

S = RequestStatus
BLOCK = 4


def make(role: str, num_blocks: int = 16, budget: int = 16, lease_timeout: float = 30.0) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK)
    sources = [PrefixCacheSource(kv)] + ([TransferSource()] if role == "decode" else [])
    policy = PrefillOnly(kv, lease_timeout) if role == "prefill" else RolePolicy()
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=8, sources=sources,
                                    role=policy))


def request(rid: str, num_prompt: int, max_tokens: int = 3, base: int = 100) -> Request:
    return Request(rid, list(range(base, base + num_prompt)), SamplingParams(max_tokens=max_tokens), (2,))


def added(s: Scheduler, rid: str, num_prompt: int, **kwargs) -> Request:
    r = request(rid, num_prompt, **kwargs)
    s.add_request(r)
    return r


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    plan = s.schedule()
    sampled = {x.request.request_id: [token] * x.num_samples for x in plan.scheduled if x.sample}
    return plan, s.update(plan, RunnerOutput(sampled=sampled))


@pytest.fixture
def scheduler_for():
    """``make``, and at the end of the test: nothing unfinished, every block back in the pool."""
    made: list[Scheduler] = []

    def make_whole(role: str, **kwargs) -> Scheduler:
        made.append(make(role, **kwargs))
        return made[-1]

    yield make_whole
    for s in made:
        assert not s.num_unfinished, s.requests
        assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks, "KV blocks leaked"


def test_colocated_decodes_what_it_prefilled(scheduler_for):
    s = scheduler_for("colocated")
    a = added(s, "a", 6)
    plan, outputs = step(s)
    assert [(x.start, x.num_new_tokens, x.block_ids) for x in plan.scheduled] == [(0, 6, [0, 1])]
    assert a.status is S.RUNNING and s.running == [a] and s.num_leased == 0 and s.drain_leased() == []
    assert [o.new_token_ids for o in outputs] == [[7]]
    step(s)
    _, outputs = step(s)
    assert outputs[0].finish_reason == "length" and a.status is S.FINISHED_LENGTH


def test_prefill_leases_the_blocks_at_the_first_token_until_acked(scheduler_for):
    s = scheduler_for("prefill")
    a = added(s, "a", 6)
    _, outputs = step(s)
    assert [o.new_token_ids for o in outputs] == [[7]] and not outputs[0].finished
    assert a.status is S.KV_LEASED and s.running == [] and s.num_leased == 1
    assert s.num_unfinished == 1 and not s.has_work            # it waits, no step needed
    assert s.drain_leased() == [(a, [0, 1])] and s.drain_leased() == []
    assert s.kv.pool.num_free_blocks == 14
    assert s.schedule().is_empty
    s.acknowledge("unknown")                                     # not leased here: nothing happens
    assert s.num_leased == 1
    s.acknowledge("a")
    assert a.status is S.FINISHED_STOPPED and "a" not in s.requests and s.num_leased == 0


def test_prefill_lease_expires_with_an_error_that_names_the_timeout(scheduler_for):
    s = scheduler_for("prefill", lease_timeout=0.5)
    a = added(s, "a", 6)
    step(s)
    s.drain_leased()
    assert s.expire_leases(time.monotonic()) == []               # not yet
    (out,) = s.expire_leases(time.monotonic() + 0.5)
    assert out.request_id == "a" and out.finish_reason == "error" and out.position == 1
    assert out.error == ("the decode engine did not acknowledge the KV of request a within 0.5 s "
                         "(--kv-lease-timeout); its blocks were freed")
    assert a.status is S.FINISHED_ERROR and s.num_leased == 0
    s.acknowledge("a")                                           # a late ack changes nothing
    s.forget("a")


def test_prefill_abort_of_a_leased_request_frees_its_lease(scheduler_for):
    s = scheduler_for("prefill")
    s.add_request(request("a", 5))
    step(s)
    assert [o.finish_reason for o in s.abort("a")] == ["abort"]
    assert s.num_leased == 0 and s.expire_leases(time.monotonic() + 60) == []
    s.forget("a")


def test_prefill_serves_a_short_prompt_before_a_long_ones_chunks(scheduler_for):
    s = scheduler_for("prefill", num_blocks=32, budget=8)
    s.add_request(request("long", 20))
    step(s)
    s.add_request(request("short", 3, base=500))
    plan, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens, x.block_ids) for x in plan.scheduled] == \
        [("long", 5, [0, 1, 2, 3]), ("short", 3, [4])]
    while s.has_work:
        step(s)
    assert [(r.request_id, blocks) for r, blocks in s.drain_leased()] == [("short", [4]), ("long", [0, 1, 2, 3, 5])]
    s.acknowledge("short")
    s.acknowledge("long")


def transferred(rid: str, num_prompt: int, first_token: int = 9, payload: object = "kv") -> tuple[Request, object]:
    r = request(rid, num_prompt, max_tokens=3)
    r.output_token_ids.append(first_token)
    r.prompt_logprobs = None
    return r, payload


def test_decode_admits_a_transferred_request_with_its_kv_written_first(scheduler_for):
    s = scheduler_for("decode")
    a, payload = transferred("a", 6)
    s.add_transferred(a, payload)
    assert a.status is S.WAITING_FOR_KV and a.transferred_kv == "kv" and s.has_work
    plan, outputs = step(s, token=8)
    assert plan.kv_inserts == [("a", [0, 1], "kv")]
    assert [(x.start, x.num_new_tokens, x.block_ids, x.sample) for x in plan.scheduled] == [(6, 1, [0, 1], True)]
    assert a.num_computed_tokens == 7 and a.num_cached_tokens == 0 and a.transferred_kv is None
    assert a.status is S.RUNNING and [o.new_token_ids for o in outputs] == [[8]]
    plan, outputs = step(s)
    assert [(x.start, x.num_new_tokens, x.block_ids) for x in plan.scheduled] == [(7, 1, [0, 1])]
    assert outputs[0].finish_reason == "length" and a.output_token_ids == [9, 8, 7]


def test_decode_waits_for_blocks_then_admits_in_arrival_order(scheduler_for):
    s = scheduler_for("decode", num_blocks=4)
    big = transferred("big", 12, payload="big-kv")
    small = transferred("small", 2, payload="small-kv")
    small[0].prompt_token_ids = [600, 601]
    s.add_request(request("local", 9, max_tokens=1, base=900))   # holds 3 of the 4 blocks for a step
    plan, _ = step(s)
    assert plan.scheduled[0].block_ids == [0, 1, 2] and s.requests["local"].is_finished
    s.add_transferred(*big)
    s.add_transferred(*small)
    plan, _ = step(s)
    assert plan.kv_inserts == [("big", [3, 2, 1, 0], "big-kv")]   # the unused block, then local's, last first
    assert s.waiting_for_kv[0] is small[0]                         # no block left: it waits its turn
    s.abort("big")
    plan, _ = step(s)
    assert plan.kv_inserts == [("small", [0], "small-kv")]   # big's blocks, freed last first
    s.abort("small")
    for rid in ("local", "big", "small"):
        s.forget(rid)


def test_decode_abort_while_waiting_for_kv_drops_the_payload(scheduler_for):
    s = scheduler_for("decode")
    a, payload = transferred("a", 6)
    s.add_transferred(a, payload)
    with pytest.raises(ValueError, match="already in the engine"):
        s.add_transferred(*transferred("a", 6))
    assert [o.finish_reason for o in s.abort("a")] == ["abort"]
    assert a.transferred_kv is None and not s.waiting_for_kv and s.schedule().is_empty
    s.forget("a")


def test_core_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, duoserve.core.scheduler, duoserve.core.kv_sources, duoserve.core.roles; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_request_whose_kv_arrived_goes_on_beside_a_prompt_computed_in_chunks(scheduler_for):
    """The prompt's chunk leaves a token of the budget for each arrived request (not for more
    than arrived, nor from a running decode)."""
    s = scheduler_for("decode", num_blocks=16, budget=8)
    s.add_request(request("local", 20, max_tokens=1, base=900))   # 3 chunks of 8 at most
    plan, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in plan.scheduled] == [("local", 8)]
    a, payload = transferred("a", 6)
    s.add_transferred(a, payload)
    plan, _ = step(s)   # before: local took all 8 tokens and "a" waited for the prompt's last chunk
    assert plan.kv_inserts == [("a", [4, 5], "kv")]   # after the blocks of local's chunk
    assert sorted((x.request.request_id, x.start, x.num_new_tokens) for x in plan.scheduled) == \
        [("a", 6, 1), ("local", 8, 7)]
    plan, _ = step(s)   # "a" decodes; the prompt's last 5 tokens take what is left
    assert sorted((x.request.request_id, x.start, x.num_new_tokens) for x in plan.scheduled) == \
        [("a", 7, 1), ("local", 15, 5)]
    for rid in ("local", "a"):
        s.forget(rid)
