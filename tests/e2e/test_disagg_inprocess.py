"""Prefill and decode engines joined in one process by the in-process connector.

The handoff itself (lease, transfer, re-blocking, acknowledgement) without processes or
transports: the same tokens as a colocated engine, both pools whole afterwards.
"""

from __future__ import annotations

import random
import time

import pytest

from duoserve import SamplingParams
from duoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TurnsConfig
from duoserve.core.rates import BATCH_SIZES
from duoserve.core.request import Request, RequestStatus
from duoserve.engine.builder import build_engine
from duoserve.entrypoints.llm import LLM
from tests.disagg_helpers import joined_in_process


def engines(path, prefill_block=16, decode_block=32, lease_timeout=30.0, turns_file=None, policy="fcfs"):
    def make(role, block, slot):
        turns = TurnsConfig(turns_file, slot, quantum=0.0) if turns_file else None
        return build_engine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                                         cache=CacheConfig(block_size=block, kv_cache_memory=0.01),
                                         scheduler=SchedulerConfig(policy=policy),
                                         role=role, kv_lease_timeout=lease_timeout, turns=turns))
    return joined_in_process(make("prefill", prefill_block, 0), make("decode", decode_block, 1))


def run(prefill, decode, prompts, params, limit=2000):
    """``params``: one for all prompts, or a list of one each."""
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    finished = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(Request(f"r{i}", prompt, params[i] if isinstance(params, list) else params, (), 512))
    for _ in range(limit):
        for out in prefill.step() + decode.step():
            # both engines report the first token (position 0); keep one copy, as the frontend does
            tokens[out.request_id][out.position:] = out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if len(finished) == len(prompts) and not prefill.has_unfinished() and not decode.has_unfinished():
            return [tokens[f"r{i}"] for i in range(len(prompts))], finished
    raise AssertionError(f"not finished: {finished}")


def pool_whole(engine) -> bool:
    pool = engine.kv.pool
    return pool.num_free_blocks == pool.num_blocks and not engine.has_unfinished()


def prompts():
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]
    return [[rng.randrange(256) for _ in range(n)] for n in (1, 7, 16, 33, 90)] + [shared + [1, 2], shared + [3]]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen2_moe"])
def test_greedy_and_seeded_equal_colocated_across_block_sizes(tiny_dir, kind):
    path = tiny_dir(kind=kind)
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=20, ignore_eos=True)):
        colocated = LLM(str(path), dtype="float32", kv_cache_memory=0.01)
        want = [o.outputs[0].token_ids for o in colocated.generate(prompts(), params, use_tqdm=False)]
        prefill, decode = engines(path)
        got, finished = run(prefill, decode, prompts(), params)
        assert got == want
        assert set(finished.values()) == {"length"}
        assert prefill.kv.num_hits > 0, "the shared prefix must hit the prefill side's cache"
        assert pool_whole(prefill) and pool_whole(decode)
        assert prefill.handoff.num_transfer_bytes > 0


def test_engines_measure_the_rates_placement_reads(tiny_dir):
    prefill, decode = engines(tiny_dir(kind="llama"))
    run(prefill, decode, prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sent, took = prefill.stats(), decode.stats()
    assert any(sent.prefill_tokens_per_s) and sent.handoff_s_per_token > 0 and not any(sent.decode_step_s)
    assert not any(took.prefill_tokens_per_s), "its prompts came as KV"
    assert took.handoff_s_per_token == 0
    # by a step's decodes: 7 requests never make a step of 8 or more
    assert len(took.decode_step_s) == len(BATCH_SIZES) == 7 and BATCH_SIZES[3] == 8
    assert any(took.decode_step_s[:3]) and not any(took.decode_step_s[3:])


def test_engines_taking_turns_on_shared_cores_give_the_same_tokens(tiny_dir, tmp_path):
    """The decode engine steps in a thread of its own while the prefill engine computes prompts:
    with a quantum of 0 the prompt steps pause at their layers for it, and nothing changes."""
    import threading

    from duoserve.engine.cpu_turns import IDLE, create_turns_file

    path = tiny_dir(kind="llama")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    colocated = LLM(str(path), dtype="float32", kv_cache_memory=0.01)
    want = [o.outputs[0].token_ids for o in colocated.generate(prompts(), params, use_tqdm=False)]
    create_turns_file(str(tmp_path / "turns"), 2)
    prefill, decode = engines(path, turns_file=str(tmp_path / "turns"))
    tokens = {f"r{i}": [] for i in range(len(prompts()))}
    done = threading.Event()

    def decode_loop():
        while not done.is_set():
            for out in decode.step():
                tokens[out.request_id][out.position:] = out.new_token_ids
            time.sleep(0.0005)

    decoder = threading.Thread(target=decode_loop)
    decoder.start()
    try:
        prefill.add_request(Request("r0", prompts()[0], params, (), 512))   # one decodes while the rest prefill
        while not tokens["r0"]:
            prefill.step()
        for i, prompt in enumerate(prompts()[1:], 1):
            prefill.add_request(Request(f"r{i}", prompt, params, (), 512))
            while prefill.has_work():
                for out in prefill.step():
                    tokens[out.request_id][out.position:] = out.new_token_ids
        deadline = time.monotonic() + 120
        while any(len(t) < 40 for t in tokens.values()) and time.monotonic() < deadline:
            prefill.step()
            time.sleep(0.001)
    finally:
        done.set()
        decoder.join()
    assert [tokens[f"r{i}"] for i in range(len(prompts()))] == want
    assert prefill.turns.num_pauses > 0, "a prompt step paused for a waiting decode step"
    assert prefill.turns.words[1] == IDLE and decode.turns.words[4] == IDLE


def test_first_token_that_finishes_never_ships_kv(tiny_dir):
    prefill, decode = engines(tiny_dir(kind="llama"))
    got, finished = run(prefill, decode, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=1))
    assert len(got[0]) == 1 and finished == {"r0": "length"}
    assert prefill.handoff.num_transfer_bytes == 0 and pool_whole(prefill) and pool_whole(decode)


def test_expired_lease_frees_blocks_and_fails_the_request(tiny_dir):
    prefill, _ = engines(tiny_dir(kind="llama"), lease_timeout=0.2)
    prefill.add_request(Request("lost", [4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=5), (), 512))
    outs = prefill.step()
    assert [o.new_token_ids for o in outs if o.request_id == "lost"] and not outs[0].finished
    assert prefill.kv.pool.num_free_blocks < prefill.kv.pool.num_blocks  # leased, not freed
    assert prefill.scheduler.requests["lost"].status is RequestStatus.KV_LEASED
    time.sleep(0.25)
    (out,) = prefill.step()  # nobody acknowledged
    assert out.finish_reason == "error" and "did not acknowledge the KV of request lost within 0.2 s" in out.error
    assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_blocks


def test_abort_while_waiting_for_kv_frees_everything(tiny_dir):
    prefill, decode = engines(tiny_dir(kind="llama"))
    prefill.add_request(Request("a", list(range(30)), SamplingParams(temperature=0, max_tokens=8), (), 512))
    prefill.step()  # first token sampled, KV sent
    decode.handoff.before_step()  # arrived: WAITING_FOR_KV
    assert decode.scheduler.requests["a"].status is RequestStatus.WAITING_FOR_KV
    assert [o.finish_reason for o in decode.abort("a")] == ["abort"]
    prefill.abort("a")
    assert pool_whole(decode) and pool_whole(prefill)


def test_frontend_keeps_one_copy_of_the_first_token_whichever_engine_reports_first(tiny_dir):
    from duoserve.core.outputs import EngineCoreOutput
    from duoserve.frontend.frontend import Frontend

    engine = build_engine(EngineConfig(model=ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"),
                                       cache=CacheConfig(kv_cache_memory=0.01)))
    frontend = Frontend(engine)
    frontend.add_request([1, 2, 3], SamplingParams(max_tokens=4), request_id="x")
    engine.abort("x")  # only the frontend's bookkeeping is under test here
    decode_first = EngineCoreOutput("x", [11, 12], position=0)   # decode engine: restated first token + next
    prefill_late = EngineCoreOutput("x", [11], position=0)       # prefill engine's copy, arriving later
    (snap,) = frontend.process_outputs([decode_first])
    assert snap.outputs[0].token_ids == [11, 12] and snap.outputs[0].delta_token_ids == [11, 12]
    (snap,) = frontend.process_outputs([prefill_late, EngineCoreOutput("x", [13], position=2)])
    assert snap.outputs[0].token_ids == [11, 12, 13] and snap.outputs[0].delta_token_ids == [13]


def test_abort_that_overtakes_the_transfer_drops_it_and_frees_the_lease(tiny_dir):
    prefill, decode = engines(tiny_dir(kind="llama"))
    prefill.add_request(Request("late", list(range(20)), SamplingParams(temperature=0, max_tokens=8), (), 512))
    decode.abort("late")  # the client went away; the decode engine has not seen the request yet
    prefill.step()        # first token sampled, KV sent
    decode.step()         # the transfer arrives: dropped, acknowledged
    assert "late" not in decode.scheduler.requests and pool_whole(decode)
    prefill.abort("late")
    prefill.step()
    assert pool_whole(prefill)


def test_stop_and_release_that_overtake_the_transfer_drop_it(tiny_dir):
    """The frontend found a stop string in the first token: its FinishStopped and ReleaseRequest
    reach the decode engine before the KV. The transfer is dropped, never decoded."""
    prefill, decode = engines(tiny_dir(kind="llama"))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=2)
    prefill.add_request(Request("s", list(range(20)), params, (), 512))
    decode.finish_stopped("s/1")   # one sample stopped by a stop string
    prefill.step()                 # first tokens sampled, both samples' KV sent
    decode.step()
    assert set(decode.scheduler.requests) == {"s"}, "the stopped sample is dropped, the other decodes"
    decode.abort("s")
    decode.release("s")
    prefill.add_request(Request("t", list(range(30)), params, (), 512))
    decode.release("t")            # stopped and released before anything arrived
    for _ in range(3):
        prefill.step()
        decode.step()
    assert not decode.scheduler.requests and pool_whole(decode)
    assert pool_whole(prefill), "every dropped transfer was acknowledged: the leases are freed"


def test_a_prompt_cached_on_the_prefill_engine_reports_its_cached_tokens(tiny_dir):
    """usage.cached_tokens in disaggregated mode: the prefill engine's prefix-cache hits travel
    with the transfer (the decode engine receives the whole prompt's KV and found none itself)."""
    prefill, decode = engines(tiny_dir(kind="llama"))
    prompt = prompts()[4]   # 90 tokens: 5 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    cached = []
    for i in range(2):
        prefill.add_request(Request(f"c{i}", prompt, params, (), 512))
        final = None
        for _ in range(200):
            final = next((o for o in prefill.step() + decode.step() if o.finished and o.request_id == f"c{i}"), final)
            if final is not None and not prefill.has_unfinished() and not decode.has_unfinished():
                break
        cached.append(final.num_cached_tokens)
        for _ in range(3):   # the decode engine's acknowledgement reaches the prefill engine's lease
            prefill.step(), decode.step()
    assert cached == [0, 80]
    assert prefill.kv.num_hits == 80   # tokens
    assert pool_whole(prefill) and pool_whole(decode)


def test_tenants_and_priorities_cross_the_handoff(tiny_dir):
    """Under fair share both engines charge each tenant: the prefill engine its prompts and first
    tokens, the decode engine the rest; the decode engine's requests keep their priority."""
    path = tiny_dir(kind="llama")
    prefill, decode = engines(path, policy="fair")
    cases = [("heavy", 3), ("heavy", 3), ("light", 0)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, tenant=t, priority=p) for t, p in cases]
    batch = prompts()[:3]
    tokens, finished = run(prefill, decode, batch, params)
    alone, _ = run(*engines(path), batch, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert tokens == alone and set(finished.values()) == {"length"}
    assert prefill.scheduler.fair.counters == {"heavy": len(batch[0]) + len(batch[1]) + 2 * 2,
                                               "light": len(batch[2]) + 2}
    assert decode.scheduler.fair.counters == {"heavy": 2 * 2 * 5, "light": 2 * 5}
    assert [decode.scheduler.requests[f"r{i}"].params.priority for i in range(3)] == [3, 3, 0]
    assert pool_whole(prefill) and pool_whole(decode)
