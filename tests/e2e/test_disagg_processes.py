"""Disaggregated serving with the engines in real separate processes, over shared memory and TCP."""

from __future__ import annotations

import asyncio

import pytest

from duoserve.config import CacheConfig, DisaggConfig, EngineConfig, ModelConfig
from duoserve.frontend.async_engine import AsyncEngine
from duoserve.frontend.engine_client import EngineClient, EngineDeadError
from duoserve.frontend.launcher import _ipc_address
from duoserve.frontend.supervisor import start_engine, stop_engine
from tests.disagg_helpers import GREEDY, SEEDED, STAGE_METRICS, assert_same, generate_all, prompts, settled_stats

def run_disaggregated(path, disagg: DisaggConfig, params_list) -> tuple[list, dict]:
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory=0.01, block_size=32))

    async def main():
        engine = AsyncEngine(config, disagg=disagg)
        await engine.start()
        try:
            outs = [await generate_all(engine, prompts(), p) for p in params_list]
            return outs, await settled_stats(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_disaggregated_equals_colocated(tiny_dir, disagg_reference, transport):
    disagg = DisaggConfig(prefill_threads=1, decode_threads=1, kv_transport=transport, prefill_block_size=16)
    STAGE_METRICS.clear()
    outs, stats = run_disaggregated(tiny_dir(kind="llama"), disagg, [GREEDY, SEEDED])
    for got, want in zip(outs, disagg_reference):
        assert_same(got, want)
    for metrics in STAGE_METRICS:  # every TTFT stage was measured, on one engine or the other
        assert {"queue_seconds", "prefill_seconds", "transfer_seconds", "admit_seconds"} <= set(metrics)
        assert all(metrics[f"{s}_seconds"] >= 0 for s in ("queue", "prefill", "transfer", "admit"))
    prefill, decode = stats["prefill-0"], stats["decode-0"]
    assert prefill.kv_transfer_bytes == sum(len(p) for p in prompts()) * 2 * 2 * 2 * 16 * 4 * 2
    assert prefill.prefix_cache_hits > 0, "repeated prefixes hit the prefill engine's cache"
    assert prefill.kv_cache_usage == 0 and decode.kv_cache_usage == 0, "both pools whole again"
    assert prefill.num_running == decode.num_running == 0


def test_auto_placement_prefills_long_prompts_on_the_decode_engine(tiny_dir, disagg_reference):
    disagg = DisaggConfig(prefill_device="auto", max_prefill_len=20, prefill_threads=1, decode_threads=1)
    outs, stats = run_disaggregated(tiny_dir(kind="llama"), disagg, [GREEDY])
    assert_same(outs[0], disagg_reference[0])
    moved = sum(len(p) for p in prompts() if len(p) <= 20)
    assert stats["prefill-0"].kv_transfer_bytes == moved * 2 * 2 * 2 * 16 * 4
    # every long prompt was looked up (and prefilled) on the decode engine, every short one on the prefill engine
    assert stats["decode-0"].prefix_cache_queries == sum(len(p) for p in prompts() if len(p) > 20)
    assert stats["prefill-0"].prefix_cache_queries == moved


def _connect_refused(prefill_model: ModelConfig, decode_model: ModelConfig) -> str:
    """Start a prefill and a decode engine that must refuse each other; the prefill side's error."""
    def config(model, role):
        return EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=0.01), num_threads=1, role=role)

    async def main():
        decode = EngineClient("decode-0", _ipc_address("decode-0"), config(decode_model, "decode"))
        prefill = EngineClient("prefill-0", _ipc_address("prefill-0"), config(prefill_model, "prefill"),
                               peers={"decode-0": decode.address})
        try:
            results = await asyncio.gather(start_engine(prefill), start_engine(decode), return_exceptions=True)
            return results, prefill.is_up(), decode.is_up()
        finally:
            await asyncio.gather(stop_engine(prefill), stop_engine(decode))

    (refusal, decode_ok), prefill_up, decode_up = asyncio.run(main())
    assert isinstance(refusal, EngineDeadError) and decode_ok is None
    assert not prefill_up and decode_up, "the refused engine takes no requests; the decode engine is unharmed"
    message = str(refusal)
    assert message.startswith("prefill-0 failed to start: prefill-0 and decode-0 serve different models (")
    return message


def test_engines_of_different_models_are_refused_at_connect(tiny_dir):
    """The prefill engine's hello to the decode engine is refused, naming both sides' values."""
    message = _connect_refused(ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"),
                               ModelConfig(model=str(tiny_dir(kind="qwen2")), dtype="float32"))
    assert "architecture: prefill-0='LlamaForCausalLM', decode-0='Qwen2ForCausalLM'" in message
    assert "qkv_bias: prefill-0=False, decode-0=True" in message


def test_engines_quantizing_differently_are_refused_at_connect(tiny_dir):
    """Same weights, different quantization: the KV would differ, so the engines refuse each other."""
    path = str(tiny_dir(kind="llama"))
    message = _connect_refused(ModelConfig(model=path, dtype="float32"),
                               ModelConfig(model=path, dtype="float32", quantization="int8"))
    assert message.endswith("(quantization: prefill-0='none', decode-0='int8')")


async def one(engine, request_id: str, prompt: list[int]):
    final = None
    async for out in engine.generate(prompt, GREEDY, request_id, strict_length=False):
        final = out
    return final.outputs[0]


def test_a_killed_prefill_engines_prompt_is_prefilled_on_the_decode_engine_until_restart(tiny_dir):
    """The prefill engine dies with a prompt it never prefilled: the prompt starts over on the
    decode engine (no prefill engine is up), as do new ones until the prefill engine is back."""
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
            task = asyncio.ensure_future(generate_all(engine, [long_prompt], GREEDY))
            await asyncio.sleep(0.2)
            placed_on = engine.group.placements["r0"].prefill
            os.kill(first_pid, signal.SIGKILL)
            (moved,) = await asyncio.wait_for(task, 30)
            fallback = await generate_all(engine, [[5, 6, 7]], GREEDY)   # new requests too
            for _ in range(200):
                if prefill.is_alive() and prefill.process.pid != first_pid and prefill.ready is not None:
                    break
                await asyncio.sleep(0.1)
            # under ids of their own: the decode engine was told to abort "r0" (it might have held
            # a transfer of it) and refuses a later transfer under that id (see the closing note)
            after = [await one(engine, f"after-{i}", p) for i, p in enumerate([[5, 6, 7], long_prompt])]
            return placed_on, moved, fallback, after, prefill.process.pid != first_pid, await settled_stats(engine)
        finally:
            await engine.shutdown()

    placed_on, moved, fallback, after, restarted, stats = asyncio.run(main())
    assert placed_on == "prefill-0"
    assert moved.finish_reason == "length" and moved.error is None
    assert_same([moved], after[1:])
    assert len(fallback[0].token_ids) == 16 and after[0].token_ids == fallback[0].token_ids
    assert restarted
    assert stats["decode-0"].kv_cache_usage == 0 and stats["prefill-0"].kv_cache_usage == 0
