"""Read a request's KV out of a paged cache, and write it into another, whatever either's block size.

The wire format carries KV per token; each side maps tokens to its own blocks::

    sender, block_size 16:   [b7: t0..t15][b2: t16..t31][b9: t32..]
    wire:                     t0 t1 ... tN            (per layer, K then V)
    receiver, block_size 32: [b4: t0..t31][b0: t32..]
"""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _slots(block_ids: list[int], block_size: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    offsets = torch.arange(block_size, device=device)
    return (blocks[:, None] * block_size + offsets).reshape(-1)[:num_tokens]  # [num_tokens]


def extract_kv(kv_caches: KVCaches, block_ids: list[int], num_tokens: int) -> tuple[list, list]:
    """Per layer K and V [num_tokens, num_kv_heads, head_dim] of the first ``num_tokens`` tokens."""
    k0 = kv_caches[0][0]
    block_size, heads, dim = k0.shape[1:]
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    slots = _slots(block_ids, block_size, num_tokens, k0.device)
    keys = [k.view(-1, heads, dim).index_select(0, slots) for k, _ in kv_caches]
    values = [v.view(-1, heads, dim).index_select(0, slots) for _, v in kv_caches]
    return keys, values


def insert_kv(kv_caches: KVCaches, block_ids: list[int], keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> None:
    """Write per-layer K/V [num_tokens, num_kv_heads, head_dim] into ``block_ids``, converting dtype."""
    if len(keys) != len(kv_caches):
        raise ValueError(f"KV for {len(keys)} layers, but this cache has {len(kv_caches)}")
    k0 = kv_caches[0][0]
    block_size, heads, dim = k0.shape[1:]
    num_tokens = keys[0].shape[0]
    if tuple(keys[0].shape[1:]) != (heads, dim):
        raise ValueError(f"KV heads x head_dim {tuple(keys[0].shape[1:])}, but this cache has {(heads, dim)}")
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    slots = _slots(block_ids, block_size, num_tokens, k0.device)
    for (k_cache, v_cache), k, v in zip(kv_caches, keys, values):
        k_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(device=k0.device, dtype=k_cache.dtype))
        v_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(device=k0.device, dtype=v_cache.dtype))
