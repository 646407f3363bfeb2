"""Paged attention in the C kernels: a backend the runner swaps in for the model's torch reference.

``csrc/paged_decode.c`` reads each row's keys and values straight from their blocks: a
decoding sequence is one row over its context; a prompt chunk's query tokens are rows over
their own causal contexts (their keys and values are written before any row attends), which
``csrc/paged_prefill.c`` tiles. ``CAttention`` runs a layer so: a step of decodes in one C++
call (``duoserve::decode_attention``, the KV write included) where csrc/cpu_ops.cpp builds, any
other step as one KV write and one C call per part (the decodes, then each prompt chunk).
``OpAttention`` is the same layer as one opaque op inside a compiled graph (``ops``).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from duoserve.kernels.build import load_c_function
from duoserve.kernels.ops import C_CACHE_DTYPES, StepMetadata, decode_attention_op

_P, _I = ctypes.c_void_p, ctypes.c_int


def paged_decode_kernel():
    return load_c_function("paged_decode", "paged_decode_attention",
                           (_P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_float,
                            _I))


def c_attention_serves(device: torch.device | str, kv_dtype: torch.dtype) -> bool:
    """Whether the C attention kernels build here and read a KV cache of ``kv_dtype`` on ``device``."""
    return torch.device(device).type == "cpu" and kv_dtype in C_CACHE_DTYPES and paged_decode_kernel() is not None


def c_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float, window: int | None = None,
                       cap: float | None = None) -> torch.Tensor | None:
    """q: [num_rows, num_heads, head_dim], each row over its block table [num_rows, max_blocks] and
    length [num_rows] (its last ``window`` keys only, where given; scores soft-capped at ``cap``,
    where given) -> out [num_rows, num_heads * head_dim] float32, or None."""
    fn = paged_decode_kernel()
    if fn is None or q.device.type != "cpu" or k_cache.dtype not in C_CACHE_DTYPES:
        return None
    num_seqs, num_heads, head_dim = q.shape
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    status = fn(q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
                block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
                k_cache.shape[2], head_dim, k_cache.shape[1], block_tables.shape[1], scale, window or 0, cap or 0.0,
                torch.get_num_threads())
    if status != 0:
        return None
    return out.view(num_seqs, num_heads * head_dim)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] into the caches at ``slot_mapping`` (before any row attends)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class CAttention(nn.Module):
    """A layer's attention in the C kernels, its sliding window and score cap included.
    ``reference`` is the module it replaces (the torch reference, with the layer's ``scale``,
    ``window`` and ``cap``): it runs a part the C kernel declines (out of scratch memory), after
    the same KV write."""

    def __init__(self, reference: nn.Module) -> None:
        super().__init__()
        self.reference = reference
        self.scale = reference.scale
        self.window = reference.window
        self.cap = reference.cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: StepMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] -> [num_tokens,
        num_heads * head_dim]; k and v written into the caches first."""
        k_cache, v_cache = kv_cache
        window, cap = self.window or 0, self.cap or 0.0
        num_decodes = meta.num_decode_tokens
        if num_decodes and not meta.prefills:
            op = decode_attention_op()   # a decode step: one C++ call instead of ~8 torch ops from Python
            if op is not None:
                return op(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                          meta.decode_seq_lens, self.scale, window, cap)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        parts = []
        if num_decodes:
            out = c_decode_attention(q[:num_decodes], k_cache, v_cache, meta.decode_block_tables,
                                     meta.decode_seq_lens, self.scale, window, cap)
            if out is None:
                return self.reference(q, k, v, kv_cache, meta)
            parts.append(out.to(q.dtype))
        for seq in meta.prefills:
            out = c_decode_attention(q[seq.query_start:seq.query_start + seq.query_len], k_cache, v_cache,
                                     seq.token_block_tables, seq.token_seq_lens, self.scale, window, cap)
            if out is None:
                return self.reference(q, k, v, kv_cache, meta)
            parts.append(out.to(q.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


class OpAttention(nn.Module):
    """A layer's attention as one opaque op while compiling (its cache and metadata come from the
    context, ``ops.StepContext``); run eagerly, the module it wraps."""

    def __init__(self, eager: nn.Module, context: int, layer: int) -> None:
        super().__init__()
        self.eager, self.context, self.layer = eager, context, layer

    def forward(self, q, k, v, kv_cache, meta) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.duoserve.paged_attention(q, k, v, self.context, self.layer)
        return self.eager(q, k, v, kv_cache, meta)
