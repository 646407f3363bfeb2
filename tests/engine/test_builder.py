"""EngineBuilder: what an engine's role and configuration decide, decided once at build."""

from __future__ import annotations

import pytest

from duoserve.config import CacheConfig, EngineConfig, KVStoreConfig, ModelConfig
from duoserve.core.kv_sources import PrefixCacheSource, SwapSource, TransferSource
from duoserve.core.roles import PrefillOnly, RolePolicy
from duoserve.engine.builder import build_engine
from duoserve.engine.handoff import Handoff, ReceiveKV, SendKV
from duoserve.errors import ConfigError
from duoserve.worker.kv_cache import bytes_per_token
from duoserve.worker.memory import estimate_prefill_scratch


def config(path, role: str = "colocated", **cache) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                        cache=CacheConfig(**{"kv_cache_memory": 0.01, **cache}), role=role)


@pytest.mark.parametrize("role, handoff, policy, last_source", [
    ("colocated", Handoff, RolePolicy, PrefixCacheSource),
    ("prefill", SendKV, PrefillOnly, PrefixCacheSource),
    ("decode", ReceiveKV, RolePolicy, TransferSource),
])
def test_the_role_chooses_the_handoff_the_policy_and_the_kv_sources(tiny_dir, role, handoff, policy, last_source):
    engine = build_engine(config(tiny_dir(kind="llama"), role))
    assert type(engine.handoff) is handoff and type(engine.scheduler.role) is policy
    assert type(engine.scheduler.sources[0]) is PrefixCacheSource and type(engine.scheduler.sources[-1]) is last_source


def test_swap_space_is_a_source_after_the_prefix_cache_and_sized_in_whole_blocks(tiny_dir):
    path = tiny_dir(kind="llama")
    engine = build_engine(config(path, swap_space=0.001))
    block_bytes = bytes_per_token(engine.arch, engine.runner.kv_caches[0][0].dtype) * 16
    assert engine.num_swap_blocks == int(0.001 * 2**30) // block_bytes
    assert [type(s) for s in engine.scheduler.sources] == [PrefixCacheSource, SwapSource]
    assert engine.memory["swap"] == {"blocks": engine.num_swap_blocks, "bytes": engine.num_swap_blocks * block_bytes}


def test_the_kv_store_needs_the_prefix_cache(tiny_dir):
    with pytest.raises(ConfigError) as err:
        build_engine(EngineConfig(model=ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"),
                                  cache=CacheConfig(kv_cache_memory=0.01, enable_prefix_caching=False),
                                  kv_store=KVStoreConfig("redis://127.0.0.1:1/0")))
    assert str(err.value).startswith("enable_prefix_caching=False is not allowed: on with --kv-store")


def test_the_memory_report_estimates_the_prefill_scratch_from_shapes(tiny_dir, monkeypatch):
    monkeypatch.delenv("DUOSERVE_MEASURE_SCRATCH", raising=False)
    engine = build_engine(config(tiny_dir(kind="llama")))
    report = engine.memory
    tokens = report["prefill_scratch_tokens"]
    assert tokens == 512 and report["prefill_scratch_measured"] is False
    assert report["prefill_scratch_bytes"] == estimate_prefill_scratch(engine.arch, 512, 4)
    pool = report["kv_pool"]
    assert pool["bytes"] == pool["blocks"] * 16 * bytes_per_token(engine.arch, engine.runner.kv_caches[0][0].dtype)
    assert pool["blocks"] == engine.num_blocks
