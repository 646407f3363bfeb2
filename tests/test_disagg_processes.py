"""Disaggregated serving with the engines in real separate processes, over shared memory and TCP."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from duoserve import LLM, SamplingParams
from duoserve.config import CacheConfig, DisaggConfig, EngineConfig, ModelConfig
from duoserve.frontend.async_engine import AsyncEngine
from duoserve.frontend.engine_client import EngineDeadError, EngineProcessClient
from duoserve.frontend.router import check_same_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=21, max_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(8)
    shared = [rng.randrange(256) for _ in range(35)]
    return ([[rng.randrange(256) for _ in range(n)] for n in (1, 6, 17, 40, 100)]
            + [shared + [5], shared + [6, 7], list(shared + [5])])


STAGE_METRICS: list[dict] = []   # the final metrics of every request of the last run


async def _generate_all(engine: AsyncEngine, items, params) -> list:
    async def one(i, prompt):
        final = None
        async for out in engine.generate(prompt, params, f"r{i}", strict_length=False):
            final = out
        STAGE_METRICS.append(final.metrics)
        return final.outputs[0]

    results = []
    for i, prompt in enumerate(items):  # the repeated prefix must be computed before it can hit
        results.append(await one(i, prompt))
    return results


def run_disaggregated(path, disagg: DisaggConfig, params_list) -> tuple[list, dict]:
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory=0.01, block_size=32))

    async def main():
        engine = AsyncEngine(config, disagg=disagg)
        await engine.start()
        try:
            outs = [await _generate_all(engine, prompts(), p) for p in params_list]
            await asyncio.sleep(1.3)  # a stats message from each engine
            return outs, dict(engine.stats)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def colocated(tiny_dir):
    """The reference, computed like the engines (one thread: matmul sums in the same order)."""
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_dir(kind="llama")), dtype="float32", kv_cache_memory=0.01, num_threads=1)
        return [[o.outputs[0] for o in llm.generate(prompts(), p, use_tqdm=False)] for p in (GREEDY, SEEDED)]
    finally:
        torch.set_num_threads(threads)


def assert_same(got, want) -> None:
    """Identical tokens; for greedy, a first divergence is accepted only at a near-tie (gap < 1e-3)."""
    for g, w in zip(got, want):
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a != b:
                assert w.logprobs is not None, f"sampled tokens differ at {i}: {a} vs {b}"
                top = w.logprobs[i].top
                assert top[0][1] - top[1][1] < 1e-3, f"token {i} differs ({a} vs {b}) away from a tie"
                print(f"near-tie divergence at token {i}, accepted")
                break
        else:
            assert len(g.token_ids) == len(w.token_ids)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_disaggregated_equals_colocated(tiny_dir, colocated, transport):
    disagg = DisaggConfig(prefill_threads=1, decode_threads=1, kv_transport=transport, prefill_block_size=16)
    STAGE_METRICS.clear()
    outs, stats = run_disaggregated(tiny_dir(kind="llama"), disagg, [GREEDY, SEEDED])
    for got, want in zip(outs, colocated):
        assert_same(got, want)
    for metrics in STAGE_METRICS:  # every TTFT stage was measured, on one engine or the other
        assert {"queue_seconds", "prefill_seconds", "transfer_seconds", "admit_seconds"} <= set(metrics)
        assert all(metrics[f"{s}_seconds"] >= 0 for s in ("queue", "prefill", "transfer", "admit"))
    prefill, decode = stats["prefill-0"], stats["decode-0"]
    assert prefill.kv_transfer_bytes == sum(len(p) for p in prompts()) * 2 * 2 * 2 * 16 * 4 * 2
    assert prefill.prefix_cache_hits > 0, "repeated prefixes hit the prefill engine's cache"
    assert prefill.kv_cache_usage == 0 and decode.kv_cache_usage == 0, "both pools whole again"
    assert prefill.num_running == decode.num_running == 0


def test_auto_placement_prefills_long_prompts_on_the_decode_engine(tiny_dir, colocated):
    disagg = DisaggConfig(prefill_device="auto", max_prefill_len=20, prefill_threads=1, decode_threads=1)
    outs, stats = run_disaggregated(tiny_dir(kind="llama"), disagg, [GREEDY])
    assert_same(outs[0], colocated[0])
    moved = sum(len(p) for p in prompts() if len(p) <= 20)
    assert stats["prefill-0"].kv_transfer_bytes == moved * 2 * 2 * 2 * 16 * 4
    # every long prompt was looked up (and prefilled) on the decode engine, every short one on the prefill engine
    assert stats["decode-0"].prefix_cache_queries == sum(len(p) for p in prompts() if len(p) > 20)
    assert stats["prefill-0"].prefix_cache_queries == moved


def test_engines_of_different_models_are_refused_at_connect(tiny_dir):
    def client(kind, name):
        return EngineProcessClient(EngineConfig(model=ModelConfig(model=str(tiny_dir(kind=kind))),
                                                cache=CacheConfig(kv_cache_memory=0.01), num_threads=1,
                                                role="prefill" if name.startswith("p") else "decode"),
                                   name, {"kv_addr": "tcp://127.0.0.1:0", "ack_addr": "tcp://127.0.0.1:0"})

    async def main():
        a, b = client("llama", "prefill-0"), client("qwen2", "decode-0")
        try:
            await asyncio.gather(a.start(), b.start())
            with pytest.raises(EngineDeadError) as err:
                check_same_model(a, b)
            return str(err.value)
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())

    message = asyncio.run(main())
    assert message.startswith("prefill and decode engines serve different models (")
    assert "architecture: prefill-0='LlamaForCausalLM', decode-0='Qwen2ForCausalLM'" in message
    assert "qkv_bias: prefill-0=False, decode-0=True" in message


def test_killed_prefill_engine_fails_its_request_then_decode_prefills_until_restart(tiny_dir):
    import os
    import signal

    config = EngineConfig(model=ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory=0.01))
    disagg = DisaggConfig(prefill_threads=1, decode_threads=1)
    long_prompt = list(range(1, 200))

    async def main():
        engine = AsyncEngine(config, disagg=disagg)
        await engine.start()
        prefill = engine.clients[0]
        first_pid = prefill.process.pid
        try:
            os.kill(first_pid, signal.SIGSTOP)  # frozen: the request is placed on it but never prefilled
            stream = engine.generate(long_prompt, GREEDY, "doomed", strict_length=False)
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.2)
            os.kill(first_pid, signal.SIGKILL)
            with pytest.raises(Exception) as err:
                await asyncio.wait_for(task, 20)
                async for _ in stream:
                    pass
            detected = "prefill engine died" in str(err.value)
            # meanwhile the decode engine prefills new requests itself
            fallback = await _generate_all(engine, [[5, 6, 7]], GREEDY)
            for _ in range(200):
                if prefill.is_alive() and prefill.process.pid != first_pid and prefill.ready is not None:
                    break
                await asyncio.sleep(0.1)
            after = await _generate_all(engine, [[5, 6, 7]], GREEDY)
            await asyncio.sleep(1.3)
            return detected, fallback, after, prefill.process.pid != first_pid, dict(engine.stats)
        finally:
            await engine.shutdown()

    detected, fallback, after, restarted, stats = asyncio.run(main())
    assert detected
    assert len(fallback[0].token_ids) == 16 and after[0].token_ids == fallback[0].token_ids
    assert restarted
    assert stats["decode-0"].kv_cache_usage == 0 and stats["prefill-0"].kv_cache_usage == 0
