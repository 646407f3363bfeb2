"""--scheduling-policy fair in the scheduler: tenants served by their virtual token counters
(VTC), a tenant served less preempting one served more when the batch is full, weights, the
counters charged once per computed token, and deadlines dropping requests before their first
step (no torch, no model)."""

from __future__ import annotations

from duoserve.core.fair_share import ARRIVAL_CREDIT, MARGIN, FairShare
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import PrefixCacheSource
from duoserve.core.request import Request, RequestStatus
from duoserve.core.scheduler import QUEUE_TIMEOUT, Scheduler, SchedulerSetup
from duoserve.sampling_params import SamplingParams
from tests.core.test_scheduler import add, fake_run, run_to_end

S = RequestStatus


def fair_scheduler(num_blocks=64, block_size=4, budget=8, max_seqs=8, weights=()) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, True)
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                    sources=[PrefixCacheSource(kv)], policy="fair", tenant_weights=weights))


def step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, fake_run(plan))
    return plan


def admitted_order(s: Scheduler, steps: int) -> list[str]:
    return [i.request.request_id for _ in range(steps) for i in step(s).scheduled if i.start == 0]


def test_a_light_tenant_goes_before_a_heavy_tenants_backlog():
    s = fair_scheduler(budget=4)
    for i in range(6):
        add(s, f"heavy{i}", 4, max_tokens=1, tenant="heavy")
    s.fair.charge(s.requests["heavy1"], 2000, 0)   # heavy has been served 2000 tokens more
    step(s)   # heavy0 served
    add(s, "light0", 4, max_tokens=1, tenant="light")   # arrives ARRIVAL_CREDIT below heavy's counter
    add(s, "light1", 4, max_tokens=1, tenant="light")
    # one prompt a step: light's two go first, their 12 tokens still leaving light below heavy
    order = admitted_order(s, 7)
    assert order == ["light0", "light1", "heavy1", "heavy2", "heavy3", "heavy4", "heavy5"]
    assert s.fair.counter("light") == 2006 - ARRIVAL_CREDIT + 2 * (4 + 2)
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks and not s.fair.active


def test_under_fcfs_the_same_arrivals_wait_behind_the_backlog():
    kv = KVCacheManager(64, 4, True)
    s = Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=4, max_num_seqs=8, sources=[PrefixCacheSource(kv)]))
    for i in range(6):
        add(s, f"heavy{i}", 4, max_tokens=1, tenant="heavy")
    step(s)
    add(s, "light0", 4, max_tokens=1, tenant="light")
    assert admitted_order(s, 6)[-1] == "light0"


def test_weights_give_unequal_shares():
    s = fair_scheduler(budget=4, weights=(("gold", 3.0),))
    for i in range(8):
        add(s, f"gold{i}", 4, max_tokens=1, tenant="gold")
        add(s, f"free{i}", 4, max_tokens=1, tenant="free")
    order = admitted_order(s, 8)
    # each request costs 4 + 2 tokens, a third of that for gold: gold is picked three times as often
    assert sum(r.startswith("gold") for r in order) == 6 and sum(r.startswith("free") for r in order) == 2
    run_to_end(s)


def test_a_tenant_served_less_preempts_the_newest_of_the_one_served_most():
    s = fair_scheduler(max_seqs=2, budget=8)
    heavy = [add(s, f"heavy{i}", 3, max_tokens=20, tenant="heavy") for i in range(2)]
    step(s)
    step(s)
    light = add(s, "light", 3, max_tokens=2, tenant="light")   # at 0: ARRIVAL_CREDIT below heavy's lifts nothing
    s.fair.charge(heavy[0], MARGIN - s.fair.counter("heavy"), 0)   # heavy exactly MARGIN above: no preemption
    assert step(s).preempted_ids == [] and light.status is S.WAITING   # (two more tokens charged to heavy)
    plan = step(s)
    assert plan.preempted_ids == ["heavy1"] and light.status is S.RUNNING
    assert heavy[1].status is S.WAITING and heavy[1].num_computed_tokens == 0
    run_to_end(s)
    assert all(r.num_output_tokens == 20 for r in heavy) and light.num_output_tokens == 2
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_one_tenant_never_preempts_itself():
    s = fair_scheduler(max_seqs=2, budget=8)
    for i in range(4):
        add(s, f"r{i}", 3, max_tokens=5, tenant="only")
    plans = run_to_end(s)
    assert all(not p.preempted_ids for p in plans) and s.num_preemptions == 0


def test_tokens_are_charged_once_prompt_and_outputs_weighted():
    s = fair_scheduler(budget=8)
    add(s, "a", 6, max_tokens=3, tenant="t")
    run_to_end(s)
    assert s.fair.counter("t") == 6 * 1 + 3 * 2
    share = FairShare()
    r = Request("x", [1, 2, 3], SamplingParams(tenant="late"))
    share.counters["busy"] = 5000.0
    share.active["busy"] = 1
    share.arrive(r)
    assert share.counter("late") == 5000.0 - ARRIVAL_CREDIT   # idling earned no more credit than that


def test_a_recomputed_prompt_is_not_charged_again():
    s = fair_scheduler(max_seqs=1, budget=8)
    a = add(s, "a", 4, max_tokens=6, tenant="slow")
    step(s)
    b = add(s, "b", 4, max_tokens=1, priority=-1, tenant="fast")   # preempts a by priority
    step(s)
    assert a.status is S.WAITING and a.num_preemptions == 1
    run_to_end(s)
    assert s.fair.counter("slow") == 4 + 6 * 2 and b.num_output_tokens == 1


def test_a_request_past_its_timeout_is_dropped_before_its_prompt_step():
    s = fair_scheduler(max_seqs=1, budget=8)
    busy = add(s, "busy", 4, max_tokens=5)
    step(s)
    late = add(s, "late", 4, max_tokens=2, timeout=0.5)
    patient = add(s, "patient", 4, max_tokens=2, timeout=60)
    assert s.expire_deadlines(late.arrival_time + 0.4) == []
    outputs = s.expire_deadlines(late.arrival_time + 0.6)
    assert [o.request_id for o in outputs] == ["late"] and outputs[0].finish_reason == "error"
    assert outputs[0].error.startswith(QUEUE_TIMEOUT) and late.num_computed_tokens == 0
    run_to_end(s)
    assert busy.num_output_tokens == 5 and patient.num_output_tokens == 2
    assert s.expire_deadlines(patient.arrival_time + 100) == []   # started in time: never dropped
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_the_step_that_computes_a_tenants_prompt_takes_none_of_a_tenant_served_far_more():
    s = fair_scheduler(budget=16)
    add(s, "heavy0", 4, max_tokens=3, tenant="heavy")
    s.fair.charge(s.requests["heavy0"], 2000, 0)
    heavy1 = add(s, "heavy1", 4, max_tokens=1, tenant="heavy")
    light = add(s, "light", 4, max_tokens=1, tenant="light")   # ARRIVAL_CREDIT below heavy
    # the budget holds all three prompts: light's goes alone (heavy's wait a step)
    assert [i.request.request_id for i in step(s).scheduled] == ["light"]
    assert heavy1.status is S.WAITING and light.is_finished
    assert [i.request.request_id for i in step(s).scheduled] == ["heavy0", "heavy1"]
    run_to_end(s)
