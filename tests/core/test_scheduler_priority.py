"""--scheduling-policy priority in the scheduler: queues by priority (lower first, then the role's
order), a waiting request of a better priority preempting running ones when the batch or the KV
pool is full, and fcfs unchanged (no torch, no model)."""

from __future__ import annotations

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import PrefixCacheSource
from duoserve.core.request import RequestStatus
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from tests.core.test_scheduler import add, fake_run, run_to_end

S = RequestStatus


def priority_scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=8, policy="priority") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, True)
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                    sources=[PrefixCacheSource(kv)], policy=policy))


def step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, fake_run(plan))
    return plan


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = priority_scheduler(budget=4, max_seqs=8)
    for rid, priority in (("a", 5), ("b", 0), ("c", 5), ("d", 0)):
        add(s, rid, 4, max_tokens=1, priority=priority)
    admitted = [[i.request.request_id for i in step(s).scheduled] for _ in range(4)]
    assert admitted == [["b"], ["d"], ["a"], ["c"]]   # one 4-token prompt a step: best first
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_fcfs_ignores_priorities():
    s = priority_scheduler(budget=4, policy="fcfs")
    for rid, priority in (("a", 5), ("b", 0)):
        add(s, rid, 4, max_tokens=1, priority=priority)
    assert [i.request.request_id for i in step(s).scheduled] == ["a"]
    run_to_end(s)


def test_a_better_priority_preempts_the_worst_running_when_the_batch_is_full():
    s = priority_scheduler(max_seqs=2, budget=8)
    low = [add(s, f"low{i}", 3, max_tokens=20, priority=10) for i in range(2)]
    step(s)
    assert [r.status for r in low] == [S.RUNNING, S.RUNNING]
    urgent = add(s, "urgent", 3, max_tokens=2, priority=0)
    plan = step(s)
    assert plan.preempted_ids == ["low1"]      # the newest of the worst priority
    assert urgent.status is S.RUNNING and low[1].status is S.WAITING and low[1].num_computed_tokens == 0
    assert [i.request.request_id for i in plan.scheduled] == ["urgent"]   # low0 waits this step: its KV kept
    assert low[0].status is S.RUNNING
    run_to_end(s)
    assert all(r.is_finished and r.num_output_tokens == 20 for r in low) and urgent.num_output_tokens == 2
    assert s.num_preemptions == 1 and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_a_better_priority_preempts_when_blocks_run_short_and_an_equal_one_waits():
    # 4 blocks of 4 tokens: two running requests of 8 tokens hold them all
    s = priority_scheduler(num_blocks=4, block_size=4, budget=16, max_seqs=8)
    low = [add(s, f"low{i}", 7, max_tokens=10, priority=3) for i in range(2)]
    step(s)
    same = add(s, "same", 4, max_tokens=1, priority=3)
    plan = step(s)
    assert plan.preempted_ids == [] and same.status is S.WAITING   # no better: it waits its turn
    assert s.kv.pool.num_free_blocks == 0
    urgent = add(s, "urgent", 4, max_tokens=1, priority=1)
    plan = step(s)
    assert plan.preempted_ids == ["low1"] and urgent.is_finished and same.status is S.WAITING
    assert [i.request.request_id for i in plan.scheduled] == ["urgent"]   # low0 waits this step: its KV kept
    assert low[0].status is S.RUNNING
    run_to_end(s)
    assert all(r.is_finished for r in (*low, same, urgent)) and [r.num_output_tokens for r in low] == [10, 10]
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_a_preempted_request_resumes_after_the_better_ones_and_before_its_equals():
    s = priority_scheduler(max_seqs=1, budget=8)
    first = add(s, "first", 3, max_tokens=6, priority=5)
    step(s)
    later = add(s, "later", 3, max_tokens=1, priority=5)
    urgent = add(s, "urgent", 3, max_tokens=1, priority=0)
    plan = step(s)
    assert plan.preempted_ids == ["first"] and [i.request.request_id for i in plan.scheduled] == ["urgent"]
    order = []
    while s.num_unfinished:
        plan = step(s)
        order += [i.request.request_id for i in plan.scheduled if i.start == 0]
    assert order == ["first", "later"]   # the preempted one ahead of an equal that arrived after it
    assert first.num_output_tokens == 6 and later.is_finished and urgent.is_finished
