"""EngineCore's own rules, stepped by hand: abort, release and reset leave the pool whole; a
failing model step fails the requests it held, never the engine."""

from __future__ import annotations

import pytest

from duoserve import SamplingParams
from duoserve.config import CacheConfig, EngineConfig, ModelConfig
from duoserve.core.request import Request
from duoserve.engine.builder import build_engine
from tests.helpers import assert_pool_whole

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return build_engine(EngineConfig(model=ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"),
                                     cache=CacheConfig(kv_cache_memory=0.01)))


def run_out(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                engine.release(out.request_id)
    return tokens


def test_an_aborted_request_ends_with_abort_and_frees_its_blocks(engine):
    engine.add_request(Request("a", list(range(1, 30)), GREEDY, (), 512))
    (first,) = engine.step()
    assert first.new_token_ids and not first.finished
    (aborted,) = engine.abort("a")
    assert aborted.request_id == "a" and aborted.finish_reason == "abort"
    engine.release("a")
    assert engine.step() == []
    assert_pool_whole(engine)


def test_reset_ends_only_the_requests_of_one_frontend(engine):
    for request_id in ("f1:x", "f1:y", "f2:z"):
        engine.add_request(Request(request_id, list(range(5, 20)), GREEDY, (), 512))
    engine.step()
    assert engine.reset("f1:") == 2
    assert sorted(engine.scheduler.requests) == ["f2:z"]
    assert list(run_out(engine)) == ["f2:z"]
    assert_pool_whole(engine)


def test_a_failing_model_step_fails_its_requests_and_the_engine_serves_on(engine, monkeypatch):
    engine.add_request(Request("ref", list(range(7, 17)), GREEDY, (), 512))
    want = run_out(engine)["ref"]
    execute = engine.runner.execute
    calls = []

    def fail_once(plan):
        calls.append(len(plan.scheduled))
        if len(calls) == 1:
            raise RuntimeError("a kernel broke")
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", fail_once)
    engine.add_request(Request("doomed", list(range(40, 60)), GREEDY, (), 512))
    (failed,) = engine.step()
    assert failed.finish_reason == "error" and failed.error == "internal error while running the model: a kernel broke"
    engine.release("doomed")
    engine.add_request(Request("next", list(range(7, 17)), GREEDY, (), 512))
    assert run_out(engine) == {"next": want}, "the next request computes as before"
    assert_pool_whole(engine)


def test_stats_report_the_cached_blocks_once_they_change(engine):
    from duoserve.frontend.prefix_map import PrefixMap

    prompt = list(range(100, 140))   # two full blocks of 16
    engine.add_request(Request("cached", prompt, GREEDY, (), 512))
    run_out(engine)
    engine.release("cached")
    engine.measures.reported_blocks = (-1, 0.0)   # as if the last report were a second old
    reported = engine.stats().cached_blocks
    assert set(PrefixMap(16).hashes(prompt)) <= set(reported), "the frontend hashes blocks as the engine does"
    assert engine.stats().cached_blocks is None, "unchanged, and within the second: not sent again"
