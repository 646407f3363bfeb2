"""Scheduler: token budget, chunked prefill, preemption, state machine (no torch, no model)."""

from __future__ import annotations

import sys

import pytest

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import PrefixCacheSource
from duoserve.core.outputs import RunnerOutput, SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.roles import PREFILL_AGING_SECONDS, PrefillOnly
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.errors import InvalidRequestError
from duoserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=8, chunked=True, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                    enable_chunked_prefill=chunked, sources=[PrefixCacheSource(kv)]))


def prefill_scheduler(kv: KVCacheManager, budget: int, max_seqs: int) -> Scheduler:
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                    sources=[PrefixCacheSource(kv)], role=PrefillOnly(kv, 30.0)))


def fake_run(plan: SchedulerOutput, token: int = 7) -> RunnerOutput:
    return RunnerOutput(sampled={s.request.request_id: [token] * s.num_samples for s in plan.scheduled if s.sample})


def add(s: Scheduler, rid: str, num_prompt: int, max_tokens: int = 3, base: int | None = None, **kw) -> Request:
    """A request whose prompt shares no prefix with other requests unless ``base`` is given."""
    base = 1000 * (len(s.requests) + 1) if base is None else base
    req = Request(rid, list(range(base, base + num_prompt)), SamplingParams(max_tokens=max_tokens, **kw), (2,))
    s.add_request(req)
    return req


def run_to_end(s: Scheduler, limit: int = 200) -> list[SchedulerOutput]:
    plans = []
    for _ in range(limit):
        if not s.num_unfinished:
            return plans
        plan = s.schedule()
        plans.append(plan)
        s.update(plan, fake_run(plan))
    raise AssertionError("did not finish")


def test_scheduler_module_does_not_import_torch():
    import subprocess

    code = "import sys, duoserve.core.scheduler, duoserve.core.kv_cache_manager; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_chunked_prefill_under_budget_and_decodes_first():
    s = make_scheduler(budget=8)
    a = add(s, "a", 3)
    b = add(s, "b", 12)
    plan = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.sample) for x in plan.scheduled] == [
        ("a", 0, 3, True), ("b", 0, 5, False)]
    assert plan.num_batched_tokens == 8
    s.update(plan, fake_run(plan))
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.PREFILLING
    plan = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in plan.scheduled] == [("a", 3, 1), ("b", 5, 7)]
    s.update(plan, fake_run(plan))
    assert b.status is RequestStatus.RUNNING and b.output_token_ids == [7]
    run_to_end(s)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 7, 7]
    assert s.kv.pool.num_free_blocks == 16


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(budget=8, chunked=False)
    add(s, "a", 3)
    add(s, "b", 6)
    plan = s.schedule()
    assert [x.request.request_id for x in plan.scheduled] == ["a"]  # b (6) does not fit in 5
    s.update(plan, fake_run(plan))
    plan = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in plan.scheduled] == [("a", 1), ("b", 6)]
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == 16


def test_preemption_takes_the_newest_and_recomputes():
    s = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a = add(s, "a", 6, max_tokens=6)   # grows to 12 tokens: 3 blocks
    b = add(s, "b", 5, max_tokens=6)   # 2 blocks
    plan = s.schedule()
    assert [x.request.request_id for x in plan.scheduled] == ["a", "b"]
    s.update(plan, fake_run(plan))
    plans = run_to_end(s)
    preempted = [rid for p in plans for rid in p.preempted_ids]
    assert preempted and set(preempted) == {"b"}
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert s.kv.pool.num_free_blocks == 4


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        add(s, rid, 2)
    plan = s.schedule()
    assert [x.request.request_id for x in plan.scheduled] == ["a", "b"]
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == 16


def test_eos_stop_token_and_min_tokens():
    s = make_scheduler()
    eos = add(s, "eos", 2, max_tokens=5)
    early = add(s, "early", 2, max_tokens=5, min_tokens=2)
    stopid = add(s, "stopid", 2, max_tokens=5, stop_token_ids=(9,))
    ignore = add(s, "ignore", 2, max_tokens=2, ignore_eos=True)
    plan = s.schedule()
    outs = s.update(plan, RunnerOutput(sampled={"eos": [2], "early": [2], "stopid": [9], "ignore": [2]}))
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs}
    assert reasons == {"eos": ("stop", None), "early": (None, None), "stopid": ("stop", 9), "ignore": (None, None)}
    assert eos.status is RequestStatus.FINISHED_STOPPED and early.status is RequestStatus.RUNNING
    run_to_end(s)
    assert ignore.output_token_ids == [2, 7] and ignore.status is RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_free_blocks == 16 and stopid.is_finished


def test_n_samples_fork_share_prompt_blocks():
    s = make_scheduler(num_blocks=16, block_size=4, budget=16)
    add(s, "p", 6, max_tokens=2, n=3)
    plan = s.schedule()
    assert plan.scheduled[0].num_samples == 3
    outs = s.update(plan, RunnerOutput(sampled={"p": [11, 12, 13]}))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("p", [11]), ("p/1", [12]), ("p/2", [13])]
    assert s.kv.block_ids("p/1")[0] == s.kv.block_ids("p")[0] == s.kv.block_ids("p/2")[0]
    assert s.kv.pool.blocks[s.kv.block_ids("p")[0]].ref_count == 3
    plan = s.schedule()
    assert len(plan.block_copies) == 2 and all(x.num_new_tokens == 1 for x in plan.scheduled)
    s.update(plan, fake_run(plan))
    assert s.num_unfinished == 0 and s.kv.pool.num_free_blocks == 16


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_sample_without_a_block_for_its_prompt_tail_waits_or_ends(max_tokens):
    """Two blocks of 4, a 6-token prompt, n=3: no block is left for the samples' copies of the
    prompt's tail. With max_tokens=1 their first token ends them there (this raised "cannot
    move from WAITING to FINISHED_LENGTH"); with more they wait and recompute their prompt."""
    s = make_scheduler(num_blocks=2, block_size=4, budget=16)
    add(s, "p", 6, max_tokens=max_tokens, n=3)
    plan = s.schedule()
    outs = s.update(plan, RunnerOutput(sampled={"p": [11, 12, 13]}))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("p", [11]), ("p/1", [12]), ("p/2", [13])]
    if max_tokens == 1:
        assert all(o.finish_reason == "length" for o in outs) and s.num_unfinished == 0
    else:
        assert [r.request_id for r in s.waiting] == ["p/1", "p/2"]
        assert all(s.requests[r].output_token_ids == [t] for r, t in (("p/1", 12), ("p/2", 13)))
        run_to_end(s)
        assert s.num_unfinished == 0
    assert s.kv.pool.num_free_blocks == 2


def test_abort_frees_blocks_and_illegal_transition_raises():
    s = make_scheduler()
    a = add(s, "a", 6)
    plan = s.schedule()
    s.update(plan, fake_run(plan))
    outs = s.abort("a")
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert s.kv.pool.num_free_blocks == 16 and a.status is RequestStatus.FINISHED_ABORTED
    with pytest.raises(InvalidRequestError) as err:
        a.move_to(RequestStatus.RUNNING)
    assert str(err.value) == "request a: cannot move from FINISHED_ABORTED to RUNNING"
    fresh = Request("b", [1], SamplingParams())
    with pytest.raises(InvalidRequestError, match="request b: cannot move from WAITING to RUNNING"):
        fresh.move_to(RequestStatus.RUNNING)
    with pytest.raises(InvalidRequestError, match="from WAITING to KV_LEASED"):
        fresh.move_to(RequestStatus.KV_LEASED)


def test_max_tokens_zero_finishes_after_prompt():
    s = make_scheduler()
    a = add(s, "a", 5, max_tokens=0)
    plan = s.schedule()
    outs = s.update(plan, fake_run(plan))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [], "length")]
    assert a.output_token_ids == [] and s.kv.pool.num_free_blocks == 16


def test_prefix_hit_in_the_same_step_computes_only_the_rest():
    s = make_scheduler(budget=32)
    add(s, "a", 9, base=100)
    b = add(s, "b", 10, base=100)  # shares a's first two full blocks, published as a is scheduled
    plan = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in plan.scheduled] == [("a", 0, 9), ("b", 8, 2)]
    assert b.num_cached_tokens == 8 and s.kv.num_hits == 8
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == 16


def test_prefill_role_serves_the_shortest_prompts_first():
    kv = KVCacheManager(64, 4, True)
    s = prefill_scheduler(kv, 8, 8)
    add(s, "long", 30)
    first = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in first.scheduled] == [("long", 8)]
    s.update(first, fake_run(first))
    add(s, "medium", 9)
    add(s, "short", 3)
    add(s, "tiny", 2)
    # the short prompts jump the queue, shortest first, and fit whole; the long one keeps the rest
    second = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in second.scheduled] == \
        [("long", 3), ("tiny", 2), ("short", 3)]
    s.update(second, fake_run(second))
    assert s.requests["short"].status is s.requests["tiny"].status is RequestStatus.KV_LEASED
    # the medium prompt (9 > budget 8) cannot fit whole: it waits its turn by length, no budget held back
    plans = []
    for _ in range(4):
        plans.append(s.schedule())
        s.update(plans[-1], fake_run(plans[-1]))
    assert [[(x.request.request_id, x.num_new_tokens) for x in p.scheduled] for p in plans] == \
        [[("long", 8)], [("long", 8)], [("long", 3), ("medium", 5)], [("medium", 4)]]
    for rid in ("long", "short", "tiny", "medium"):
        s.acknowledge(rid)
    assert not s.num_unfinished and kv.pool.num_free_blocks == kv.pool.num_blocks


def test_prefill_role_reserves_budget_only_below_a_whole_step():
    """Waiting prompts that would take the whole budget get none held back: the long one advances."""
    kv = KVCacheManager(64, 4, True)
    s = prefill_scheduler(kv, 8, 8)
    add(s, "long", 30)
    s.update(plan := s.schedule(), fake_run(plan))
    add(s, "a", 4)
    add(s, "b", 4)  # a + b = 8 = the budget: only a is held back for
    second = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in second.scheduled] == [("long", 4), ("a", 4)]


def test_prefill_role_ages_a_long_prompt_past_a_flood_of_short_ones():
    """Short prompts keep coming, a step's budget each: without aging the long prompt would only
    ever get the token it is guaranteed; once it has waited PREFILL_AGING_SECONDS it goes first."""
    import time

    kv = KVCacheManager(256, 4, True)
    s = prefill_scheduler(kv, 8, 64)
    long = add(s, "long", 40)
    for i in range(6):                      # young: the flood takes the budget, the long one a token
        add(s, f"short{i}", 7)
        plan = s.schedule()
        got = {x.request.request_id: x.num_new_tokens for x in plan.scheduled}
        assert got.get("long", 0) <= 1, got
        s.update(plan, fake_run(plan))
    long.arrival_time = time.monotonic() - PREFILL_AGING_SECONDS - 0.1
    for i in range(6, 12):                  # aged: it takes the budget first, the flood waits
        add(s, f"short{i}", 7)
        plan = s.schedule()
        assert plan.scheduled[0].request is long or long.status is RequestStatus.KV_LEASED
        s.update(plan, fake_run(plan))
    assert long.status is RequestStatus.KV_LEASED   # prefilled (40 tokens) within the aged steps


def test_prefill_role_lets_a_short_prompt_beside_an_aged_long_one_within_half_a_step():
    import time

    kv = KVCacheManager(256, 4, True)
    s = prefill_scheduler(kv, 8, 64)
    long = add(s, "long", 40)
    s.update(plan := s.schedule(), fake_run(plan))
    long.arrival_time = time.monotonic() - PREFILL_AGING_SECONDS - 0.1
    add(s, "short", 3)
    add(s, "shorter", 2)
    plan = s.schedule()   # 2 + 3 tokens >= half the budget (4): only the shortest is held back for
    assert [(x.request.request_id, x.num_new_tokens) for x in plan.scheduled] == [("long", 6), ("shorter", 2)]
    s.update(plan, fake_run(plan))
    plan = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in plan.scheduled] == [("long", 5), ("short", 3)]


def test_a_request_whose_grammar_is_compiling_is_passed_over_not_waited_for():
    kv = KVCacheManager(16, 4, True)
    compiled: set[str] = set()
    s = Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=64, max_num_seqs=8, sources=[PrefixCacheSource(kv)],
                                 ready=lambda r: r.request_id in compiled or r.request_id == "free"))
    add(s, "slow", 5)
    add(s, "free", 5)
    add(s, "later", 5)
    plan = s.schedule()
    assert [i.request.request_id for i in plan.scheduled] == ["free"]
    assert [r.request_id for r in s.waiting] == ["slow", "later"], "they keep their places"
    s.update(plan, fake_run(plan))
    compiled.update({"slow", "later"})
    plan = s.schedule()
    assert [i.request.request_id for i in plan.scheduled] == ["free", "slow", "later"]


def test_the_token_that_completes_a_grammar_ends_the_request_and_a_broken_grammar_fails_it():
    s = make_scheduler(budget=32)
    done, broken, other = add(s, "done", 3, max_tokens=10), add(s, "broken", 3, max_tokens=10), add(s, "o", 3)
    plan = s.schedule()
    result = fake_run(plan)
    result.grammar_ended["done"] = [True]
    del result.sampled["broken"]
    result.failed["broken"] = "token 9 is outside the grammar"
    outputs = {o.request_id: o for o in s.update(plan, result)}
    assert outputs["done"].finish_reason == "stop" and outputs["done"].new_token_ids == [7]
    assert outputs["broken"].finish_reason == "error" and "outside the grammar" in outputs["broken"].error
    assert done.status is RequestStatus.FINISHED_STOPPED and broken.status is RequestStatus.FINISHED_ERROR
    assert other.status is RequestStatus.RUNNING and not outputs["o"].finished
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
