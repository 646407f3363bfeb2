"""--scheduling-policy priority end to end: a request of a better priority arriving at a full batch
preempts, and every request, preempted or not, ends with the greedy tokens it gets alone; an
engine serving in arrival order refuses a priority by name."""

from __future__ import annotations

import pytest

from duoserve import LLM, SamplingParams
from duoserve.errors import ConfigError

PROMPTS = [[5, 17, 29, 41, 53], [7, 7, 100, 3], [250, 11, 12, 13, 14, 15, 16], [9, 90, 900 % 256]]   # token ids
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_a_better_priority_preempts_and_every_text_is_the_one_it_gets_alone(tiny_dir):
    llm = LLM(str(tiny_dir(kind="llama")), dtype="float32", scheduling_policy="priority", max_num_seqs=2,
              kv_cache_memory=0.01)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    frontend = llm.frontend
    low = [frontend.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=10))
           for p in PROMPTS[:3]]
    finished = {}
    for _ in range(3):   # two of them running, one waiting
        finished.update({o.request_id: o for o in frontend.step() if o.finished})
    urgent = frontend.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             priority=0))
    first_step = True
    while frontend.has_unfinished():
        outputs = frontend.step()
        if first_step:   # the batch was full of priority 10: one of them made room at once
            assert urgent in [o.request_id for o in outputs], "the urgent request's first token in the next step"
            first_step = False
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert llm.engine.scheduler.num_preemptions >= 1
    assert [finished[r].outputs[0].token_ids for r in [*low, urgent]] == alone


def test_arrival_order_refuses_a_priority(tiny_dir):
    llm = LLM(str(tiny_dir(kind="llama")), dtype="float32", kv_cache_memory=0.01)
    with pytest.raises(ConfigError) as err:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 3])
    assert err.value.field == "priority"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 0])]


def test_fair_share_serves_a_light_tenant_before_a_heavy_backlog(tiny_dir):
    """One sequence at a time: a light tenant's request arriving behind a heavy tenant's backlog is
    served next, and every text is the one it gets alone."""
    llm = LLM(str(tiny_dir(kind="llama")), dtype="float32", scheduling_policy="fair", max_num_seqs=1,
              kv_cache_memory=0.01)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    frontend = llm.frontend
    heavy = [frontend.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, tenant="heavy"))
             for p in PROMPTS[:3]]
    done: list[str] = []
    finished = {}
    for _ in range(2):
        frontend.step()
    light = frontend.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            tenant="light"))
    while frontend.has_unfinished():
        for o in frontend.step():
            if o.finished:
                done.append(o.request_id)
                finished[o.request_id] = o
    assert done == [heavy[0], light, heavy[1], heavy[2]]
    assert [finished[r].outputs[0].token_ids for r in [*heavy, light]] == alone
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.scheduler.kv.pool.num_blocks
