"""One Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

The model knows nothing of requests: it takes a flat batch of token ids, their
positions, the per-layer KV caches and an ``AttentionMetadata`` saying where each
token's keys and values live. Q/K/V and gate/up projections are stored fused so a
layer runs three matmuls, not seven.
"""

from __future__ import annotations

import torch
from torch import nn

from duoserve.model.arch import ModelArch
from duoserve.model.attention import AttentionMetadata, PagedAttention
from duoserve.model.layers import RMSNorm, Rotary, gate_activation
from duoserve.model.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        self.arch = arch
        qkv_rows = arch.q_size + 2 * arch.kv_size
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv = nn.Linear(arch.hidden_size, qkv_rows, bias=arch.qkv_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=False)
        self.post_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.gate_up = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale,
                                   arch.window(index))
        self.rotate = Rotary()
        self.act = gate_activation(arch.hidden_act)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        arch = self.arch
        num_tokens = x.shape[0]
        qkv = self.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
        heads = arch.num_heads + arch.num_kv_heads
        qk = qkv[:, : arch.q_size + arch.kv_size].reshape(num_tokens, heads, arch.head_dim)
        v = qkv[:, arch.q_size + arch.kv_size:].reshape(num_tokens, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : arch.num_heads]), self.k_norm(qk[:, arch.num_heads:])], dim=1)
        qk = self.rotate(qk, cos, sin)  # [num_tokens, num_heads + num_kv_heads, head_dim]: Q and K at once
        q, k = qk[:, : arch.num_heads], qk[:, arch.num_heads:]
        out = self.attn(q, k, v, kv_cache, meta)  # [num_tokens, q_size]
        return self.o_proj(out)  # [num_tokens, hidden]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))  # act(gate) * up: [num_tokens, intermediate]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_norm(x))


class LlamaModel(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer   # a family's own layer and norm (gemma.py)
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, arch: ModelArch, with_rotary: bool = True) -> None:
        """``with_rotary=False``: no cos/sin tables yet (a model built on the meta device gets
        them from ``set_rotary`` once loaded, for the context it serves)."""
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(arch, i) for i in range(arch.num_layers))
        self.norm = self.norm_class(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight  # the output projection is the table itself
        if with_rotary:
            self.set_rotary(arch.max_position_embeddings)
        self.requires_grad_(False)

    def set_rotary(self, max_positions: int) -> None:
        """The cos/sin tables for positions below ``max_positions`` (the context served)."""
        self.rotary = RotaryEmbedding(self.arch.head_dim, max_positions, self.arch.rope)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights are never quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns final hidden states [num_tokens, hidden]."""
        x = self.embed(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [num_tokens, 1, head_dim]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()
