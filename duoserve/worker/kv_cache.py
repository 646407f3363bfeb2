"""Size and allocate the paged KV cache tensors of one engine."""

from __future__ import annotations

import torch

from duoserve.config import DEFAULT_CPU_KV_CACHE_GIB, CacheConfig
from duoserve.errors import ConfigError
from duoserve.model.arch import ModelArch

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


def num_kv_blocks(arch: ModelArch, cache: CacheConfig, dtype: torch.dtype, device: str, max_model_len: int,
                  draft_arch: ModelArch | None = None) -> int:
    """How many blocks the budget holds; refuses a budget too small for one full-length sequence.
    With a draft model, a block holds the draft's KV of its tokens too (same block ids)."""
    per_token = bytes_per_token(arch, dtype) + (bytes_per_token(draft_arch, dtype) if draft_arch else 0)
    per_block = per_token * cache.block_size
    num_blocks = kv_budget_bytes(cache, device) // per_block
    needed_blocks = -(-max_model_len // cache.block_size)
    if num_blocks < needed_blocks:
        needed_gib = needed_blocks * per_block / GIB
        raise ConfigError(
            "kv_cache_memory", cache.kv_cache_memory,
            f"at least {needed_gib:.4f} GiB to hold one sequence of max_model_len={max_model_len} tokens "
            f"({needed_blocks} blocks of {per_block} bytes)",
            "Raise --kv-cache-memory or lower --max-model-len",
        )
    return int(num_blocks)


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
