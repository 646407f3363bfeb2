"""How the KV pool is sized and the context it lets an engine serve (``plan_kv_pool``), with the
machine's available memory given: a 32k-context model starts with no flags on a small machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from duoserve.config import CacheConfig
from duoserve.errors import ConfigError
from duoserve.worker.kv_cache import GIB, plan_kv_pool

# Gemma 3 270M's KV layout: 18 layers, 1 KV head of 256 -> 18 KiB a token in bfloat16 (36 KiB float32)
GEMMA = SimpleNamespace(num_layers=18, num_kv_heads=1, head_dim=256)
PER_TOKEN = 2 * 18 * 256 * 4
PER_BLOCK = 16 * PER_TOKEN


def plan(max_model_len=32768, asked=False, available=8 * GIB, **cache):
    return plan_kv_pool(GEMMA, CacheConfig(**cache), torch.float32, "cpu", max_model_len, asked, available=available)


def test_the_default_holds_the_models_context_when_it_fits():
    small = plan(max_model_len=4096)   # four 4,096-token sequences: 576 MiB, less than the 1 GiB default
    assert small.num_blocks == 4 * 4096 // 16 and small.max_model_len == 4096
    assert small.note == "KV pool 0.56 GiB: 4 sequences of 4,096 tokens (--kv-cache-memory for more)"
    middle = plan(max_model_len=8192)   # four would be 1.125 GiB: the 1 GiB default
    assert middle.note is None and middle.num_blocks == GIB // PER_BLOCK
    raised = plan()   # 32,768 tokens need 1.125 GiB: raised to that, half of 8 GiB allows it
    assert raised.max_model_len == 32768 and raised.num_blocks == 32768 // 16
    assert raised.note == "KV pool raised from the 1 GiB default to 1.12 GiB to hold one 32,768-token sequence"


def test_a_small_machine_caps_the_context_and_says_so():
    capped = plan(available=int(1.5 * GIB))   # half of it is less than the default: 1 GiB holds 29,120 tokens
    assert capped.max_model_len == GIB // PER_BLOCK * 16 == 29120
    assert capped.note == ("max_model_len capped at 29,120 tokens, what a KV pool of 1.00 GiB holds (the model's "
                           "32,768 would need 1.12 GiB): give --max-model-len and --kv-cache-memory to choose")
    assert plan(available=int(2.1 * GIB)).max_model_len == int(1.05 * GIB) // PER_BLOCK * 16 == 30576


def test_an_asked_context_that_cannot_be_held_is_refused_in_words():
    with pytest.raises(ConfigError) as refused:
        plan(asked=True, available=int(1.5 * GIB))
    assert str(refused.value) == (
        "max_model_len=32768 is not allowed: a context whose KV cache fits: one 32,768-token sequence needs 1.125 "
        "GiB of KV cache, more than the 1.00 GiB the pool may take here (half of the memory available, at least "
        "the 1 GiB default). Give --max-model-len 16384 or --kv-cache-memory 1.2")
    with pytest.raises(ConfigError, match="kv_cache_memory=0.5 is not allowed: .* more than the 0.5 GiB given"):
        plan(asked=True, kv_cache_memory=0.5)


def test_a_given_pool_is_kept_and_holds_what_it_can():
    given = plan(kv_cache_memory=2.0)
    assert given.num_blocks == 2 * GIB // PER_BLOCK and given.max_model_len == 32768 and given.note is None
    assert plan(kv_cache_memory=0.5).max_model_len == GIB // 2 // PER_BLOCK * 16
