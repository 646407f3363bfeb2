"""Size and allocate the paged KV cache tensors of one engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from duoserve.config import DEFAULT_CPU_KV_CACHE_GIB, DEFAULT_CPU_KV_SEQUENCES, CacheConfig
from duoserve.errors import ConfigError
from duoserve.model.arch import ModelArch
from duoserve.platform import available_bytes

GIB = 1 << 30


def bytes_per_token(arch: ModelArch, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * torch.tensor([], dtype=dtype).element_size()


def kv_budget_bytes(cache: CacheConfig, device: str) -> int:
    if cache.kv_cache_memory is not None:
        return int(cache.kv_cache_memory * GIB)
    if device == "cpu":
        return int(DEFAULT_CPU_KV_CACHE_GIB * GIB)
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free * cache.gpu_memory_utilization)


@dataclass(frozen=True)
class KVPoolPlan:
    num_blocks: int
    max_model_len: int            # the context served: the asked or model's one, or capped to the pool
    note: str | None = None       # what a default became, for the start-up log and the memory report


def plan_kv_pool(arch: ModelArch, cache: CacheConfig, dtype: torch.dtype, device: str, max_model_len: int,
                 asked_max_model_len: bool, draft_arch: ModelArch | None = None,
                 available: int | None = None) -> KVPoolPlan:
    """The KV pool's size and the context it lets the engine serve.

    The pool must hold one sequence of the full context. On CPU with no ``--kv-cache-memory``
    the pool is 1 GiB, or four sequences of the context where that is less (a 4,096-token context
    does not reserve a gigabyte: the pool is written whole at start, so it is resident memory);
    the 1 GiB grows to one sequence when half of the memory available allows it; when it
    does not (or a given ``--kv-cache-memory`` is too small) and ``--max-model-len`` was not
    given, the context is capped at what the pool holds, as llama.cpp starts any file with
    a context it can hold; an asked context that cannot be held is refused, naming both ways
    out. With a draft model a block holds the draft's KV of its tokens too (same block ids).
    """
    per_token = bytes_per_token(arch, dtype) + (bytes_per_token(draft_arch, dtype) if draft_arch else 0)
    per_block = per_token * cache.block_size
    needed = -(-max_model_len // cache.block_size) * per_block   # one full-length sequence
    budget = kv_budget_bytes(cache, device)
    default_on_cpu = cache.kv_cache_memory is None and device == "cpu"
    if budget >= needed:
        if default_on_cpu and budget > DEFAULT_CPU_KV_SEQUENCES * needed:
            sized = DEFAULT_CPU_KV_SEQUENCES * needed
            return KVPoolPlan(sized // per_block, max_model_len,
                              f"KV pool {sized / GIB:.2f} GiB: {DEFAULT_CPU_KV_SEQUENCES} sequences of "
                              f"{max_model_len:,} tokens (--kv-cache-memory for more)")
        return KVPoolPlan(budget // per_block, max_model_len)
    limit = budget
    if default_on_cpu:
        available = available_bytes() if available is None else available
        limit = max(budget, (available or 0) // 2)
        if limit >= needed:
            return KVPoolPlan(needed // per_block, max_model_len,
                              f"KV pool raised from the {DEFAULT_CPU_KV_CACHE_GIB:g} GiB default to "
                              f"{needed / GIB:.2f} GiB to hold one {max_model_len:,}-token sequence")
    fits = limit // per_block * cache.block_size
    if asked_max_model_len or fits < cache.block_size:
        raise _too_small(cache, max_model_len, needed, fits, limit, default_on_cpu)
    return KVPoolPlan(limit // per_block, fits,
                      f"max_model_len capped at {fits:,} tokens, what a KV pool of {limit / GIB:.2f} GiB holds "
                      f"(the model's {max_model_len:,} would need {needed / GIB:.2f} GiB): give --max-model-len "
                      "and --kv-cache-memory to choose")


def _too_small(cache: CacheConfig, max_model_len: int, needed: int, fits: int, limit: int,
               default_on_cpu: bool) -> ConfigError:
    """A context the pool cannot hold, worded for a person: what it needs, and two ways out."""
    ask_gib = math.ceil(needed / GIB * 10) / 10 if needed >= GIB / 10 else math.ceil(needed / GIB * 1e4) / 1e4
    shorter = 2 ** int(math.log2(fits)) if fits >= 256 else fits
    ways = (f"give --max-model-len {shorter}" if fits >= cache.block_size else "lower --max-model-len") + \
        f" or --kv-cache-memory {ask_gib:g}"
    where = (f"more than the {limit / GIB:.2f} GiB the pool may take here (half of the memory available, at "
             f"least the {DEFAULT_CPU_KV_CACHE_GIB:g} GiB default)" if default_on_cpu
             else f"more than the {limit / GIB:.4g} GiB given")
    field, value = ("max_model_len", max_model_len) if default_on_cpu else ("kv_cache_memory", cache.kv_cache_memory)
    return ConfigError(field, value, f"a context whose KV cache fits: one {max_model_len:,}-token sequence needs "
                       f"{needed / GIB:.4g} GiB of KV cache, {where}", ways[0].upper() + ways[1:])


def allocate_kv_cache(arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], zero-filled.

    All of them are views of one buffer. Unwritten slots must hold finite numbers (masked
    attention multiplies them by 0). The buffer is written whole here, as vLLM and llama.cpp
    do with theirs: its memory is committed at start, once, and no step pays the kernel's
    page faults and page zeroing for blocks the pool hands out for the first time, which a
    cache of fresh zero pages made prompt steps pay (BENCHMARKS.md, session 9).
    """
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    per_tensor = num_blocks * block_size * arch.num_kv_heads * arch.head_dim
    total = 2 * arch.num_layers * per_tensor
    buffer = torch.zeros(total, dtype=dtype, device=device)
    views = buffer.view(arch.num_layers, 2, *shape)
    return [(views[i, 0], views[i, 1]) for i in range(arch.num_layers)]
