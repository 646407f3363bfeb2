"""Gemma 2 and Gemma 3 (text): the Llama-family decoder with Gemma's differences.

Embeddings scaled by sqrt(hidden); RMSNorms that scale by (1 + weight) in float32, four to a
layer (before and after attention, before and after the MLP: the "sandwich"); a tanh-GELU gate;
the attention scale from ``query_pre_attn_scalar``; local layers with a sliding window
interleaved with global ones. Gemma 2: every other layer local, attention scores and final
logits soft-capped (cap * tanh(x / cap)). Gemma 3: five local layers to one global, with their
own rope base, and q/k norms. The batch, cache and metadata are the Llama model's
(``llama.py``): the runner treats both alike.
"""

from __future__ import annotations

import torch
from torch import nn

from duoserve.model.arch import ModelArch
from duoserve.model.attention import AttentionMetadata, PagedAttention
from duoserve.model.layers import OffsetRMSNorm, Rotary, gate_activation
from duoserve.model.rope import RotaryEmbedding
from duoserve.model.llama import LlamaModel

KVCache = tuple[torch.Tensor, torch.Tensor]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        self.arch = arch
        self.local = arch.window(index) is not None   # a local layer: windowed, with the local rope
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_norm = OffsetRMSNorm(h, eps)
        self.qkv = nn.Linear(h, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias)
        if arch.qk_norm:
            self.q_norm = OffsetRMSNorm(arch.head_dim, eps)
            self.k_norm = OffsetRMSNorm(arch.head_dim, eps)
        self.o_proj = nn.Linear(arch.q_size, h, bias=False)
        self.post_attn_norm = OffsetRMSNorm(h, eps)
        self.pre_ffn_norm = OffsetRMSNorm(h, eps)
        self.gate_up = nn.Linear(h, 2 * arch.intermediate_size, bias=False)
        self.down = nn.Linear(arch.intermediate_size, h, bias=False)
        self.post_ffn_norm = OffsetRMSNorm(h, eps)
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale,
                                   arch.window(index), arch.attn_logit_softcap)
        self.rotate = Rotary()
        self.act = gate_activation(arch.hidden_act)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        arch = self.arch
        num_tokens = x.shape[0]
        qkv = self.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
        q = qkv[:, : arch.q_size].reshape(num_tokens, arch.num_heads, arch.head_dim)
        k = qkv[:, arch.q_size: arch.q_size + arch.kv_size].reshape(num_tokens, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = qkv[:, arch.q_size + arch.kv_size:].reshape(num_tokens, arch.num_kv_heads, arch.head_dim)
        qk = self.rotate(torch.cat([q, k], dim=1), cos, sin)  # Q and K rotated at once
        out = self.attn(qk[:, : arch.num_heads], qk[:, arch.num_heads:], v, kv_cache, meta)
        return self.o_proj(out)  # [num_tokens, hidden]

    def forward(self, x: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = rope[self.local]
        x = x + self.post_attn_norm(self.attention(self.input_norm(x), cos, sin, kv_cache, meta))
        return x + self.post_ffn_norm(self.down(self.act(self.gate_up(self.pre_ffn_norm(x)))))


class GemmaModel(LlamaModel):
    """The Llama model's embedding, head, tying and properties, with Gemma's layers and norm, two
    rope tables (global and local layers'), scaled embeddings and capped logits."""
    layer_class = GemmaDecoderLayer
    norm_class = OffsetRMSNorm

    def set_rotary(self, max_positions: int) -> None:
        self.rotary = RotaryEmbedding(self.arch.head_dim, max_positions, self.arch.rope)
        self.local_rotary = RotaryEmbedding(self.arch.head_dim, max_positions, self.arch.local_rope or self.arch.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns final hidden states [num_tokens, hidden]."""
        x = self.embed(input_ids)  # [num_tokens, hidden]
        x = x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)  # rounded to x's dtype first, as HF does
        rope = {False: self.rotary.cos_sin(positions, x.dtype), True: self.local_rotary.cos_sin(positions, x.dtype)}
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> float32 logits [n, vocab] (soft-capped in float32 for Gemma 2)."""
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
