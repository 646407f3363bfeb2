"""Steps paced by time (``core/step_pacer.py``, on by default under priority): the budget follows the
measured tokens a second, the running requests take turns when they outnumber it (each served as
often as the others of its rank), an outranking prompt still goes first, and the blocks of a
request served earlier in a step are never taken by a preemption later in it (no torch, no model)."""

from __future__ import annotations

from collections import Counter

from duoserve.config import SchedulerConfig
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import PrefixCacheSource
from duoserve.core.request import RequestStatus
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.core.step_pacer import MIN_STEP_TOKENS, StepPacer
from tests.core.test_scheduler import add, fake_run, run_to_end

S = RequestStatus


def paced(num_blocks=256, budget=64, max_seqs=64, policy="priority") -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, True)
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                    sources=[PrefixCacheSource(kv)], policy=policy, step_seconds=0.1))


def step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, fake_run(plan))
    return plan


def test_the_budget_follows_the_measured_rate():
    pacer = StepPacer(0.1, 256)
    assert pacer.budget() == 256                       # nothing measured: the configured budget
    pacer.observe(256, 1.28, 256)                      # 200 tokens a second: 20 in 0.1 s
    assert pacer.budget() == 20
    pacer.observe(5, 0.05, 20)                         # a light step (its fixed cost): not measured
    assert pacer.budget() == 20
    pacer.observe(2000, 1.0, 2000)                     # a moving average: 0.2 * 2000 + 0.8 * 200
    assert pacer.budget() == 56
    for _ in range(50):
        pacer.observe(10, 1.0, 10)
    assert pacer.budget() == MIN_STEP_TOKENS           # however slow, a step of some size
    assert StepPacer(0.1, 8).budget() == 8             # never more than the configured budget
    small = StepPacer(0.1, 8)
    small.observe(10, 1.0, 8)
    assert small.budget() == 8
    assert SchedulerConfig(policy="priority").step_seconds == 0.1 and SchedulerConfig().step_seconds is None
    assert SchedulerConfig(policy="fair").step_seconds is None   # opt-in there (BENCHMARKS.md, session 34)
    assert SchedulerConfig(policy="fair", max_step_ms=250).step_seconds == 0.25
    # without chunked prefill a prompt must fit a step: no pacing
    assert SchedulerConfig(policy="priority", enable_chunked_prefill=False).step_seconds is None
    assert SchedulerConfig(policy="priority", max_step_ms=0).step_seconds is None


def test_running_requests_take_turns_when_they_outnumber_the_budget():
    s = paced()
    requests = [add(s, f"r{i}", 1, max_tokens=12) for i in range(40)]
    step(s)                                            # 40 one-token prompts: all running
    assert all(r.status is S.RUNNING for r in requests)
    s.pacer.tokens_per_s = 160.0                       # 16 tokens a step from now on
    served = Counter()
    for _ in range(5):                                 # 80 decode rows: every request twice
        plan = step(s)
        assert plan.num_batched_tokens == 16 and all(i.num_new_tokens == 1 for i in plan.scheduled)
        served.update(i.request.request_id for i in plan.scheduled)
    assert sorted(served.values()) == [2] * 40
    run_to_end(s)
    assert all(r.num_output_tokens == 12 for r in requests) and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_an_outranking_prompt_goes_first_and_whole_in_a_paced_step():
    """The pace (16 tokens a step here) is the outranked requests': the outranking prompt is
    computed whole in its step, up to the configured budget, so its first token waits one step."""
    s = paced()
    low = [add(s, f"low{i}", 1, max_tokens=30, priority=10) for i in range(40)]
    step(s)
    s.pacer.tokens_per_s = 160.0
    urgent = add(s, "urgent", 24, max_tokens=2, priority=0)
    plan = step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in plan.scheduled] == [("urgent", 24)]
    assert plan.num_batched_tokens == 24 and urgent.num_output_tokens == 1   # its prompt done: its first token
    plan = step(s)   # then the pace again: its decode and the others' turns in 16 tokens
    assert plan.num_batched_tokens == 16 and urgent in [i.request for i in plan.scheduled]
    run_to_end(s)
    assert all(r.num_output_tokens == 30 for r in low)


def test_a_preemption_never_takes_the_blocks_of_a_request_served_in_the_same_step():
    # 12 blocks of 4 tokens: 12 requests of 3-token prompts fill them as they grow
    s = paced(num_blocks=12, budget=64, max_seqs=16)
    requests = [add(s, f"r{i}", 3, max_tokens=8) for i in range(12)]
    step(s)
    s.pacer.tokens_per_s = 160.0
    for _ in range(60):
        if not s.num_unfinished:
            break
        plan = s.schedule()
        served = {i.request.request_id for i in plan.scheduled}
        assert not served & set(plan.preempted_ids)
        s.update(plan, fake_run(plan))
    assert all(r.num_output_tokens == 8 for r in requests) and s.kv.pool.num_free_blocks == 12
