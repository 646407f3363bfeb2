"""Rotary position embeddings: the frequencies of every rope type and the cos/sin tables.

Every type is a table indexed by position, so a token's rotation is a function of its position
alone (never of its batch, its chunk or who computed the rest of its sequence's KV):

* default, linear, llama3, yarn: one set of frequencies for all positions (yarn also scales
  cos and sin by its attention factor);
* dynamic (NTK): position p is rotated with the base transformers computes for a sequence of
  max(p + 1, max_position_embeddings) tokens;
* longrope (Phi-3): the short factors, or the long ones where the served context passes the
  original one (``rope_params.for_context``), cos and sin scaled by the attention factor.

For dynamic NTK this is transformers' arithmetic when a sequence is fed a token at a time: its
generate() gives the same tokens whenever the prompt fits the original context (each decode step's
length is p + 1); a longer prompt taken in one forward is rotated there with the prompt's length
for every token instead, which no engine that caches KV per position can follow. For longrope it is
transformers' for every sequence longer than the original context (Phi-3's generate() recomputes a
sequence's KV with the long factors once it gets there) and for every sequence of a context served
within the original one.
The frequencies are computed with transformers' operations, in its order, so that the tables
match its cos and sin to float32 rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from duoserve.model.arch import RopeConfig


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [head_dim // 2]


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] of the position-independent types (and the original
    base's of dynamic)."""
    inv_freq = 1.0 / (rope.theta ** _exponents(head_dim))  # [head_dim // 2]
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn(head_dim, rope)
    if rope.rope_type == "longrope":
        return _longrope(head_dim, rope, rope.long_factor if rope.long_context else rope.short_factor)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    original = rope.original_max_position_embeddings or 8192
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Interpolated (divided by the factor) below the dimensions that turn beta_slow times over the
    original context, kept as they are above those that turn beta_fast times, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope(head_dim: int, rope: RopeConfig, factors: tuple[float, ...] | None) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * rope.theta ** _exponents(head_dim))


def _dynamic_freqs(head_dim: int, rope: RopeConfig, positions: torch.Tensor) -> torch.Tensor:
    """[n, head_dim // 2]: position p times the inverse frequencies of a sequence of
    max(p + 1, original) tokens (the original base up to the original context)."""
    original = rope.original_max_position_embeddings
    lengths = torch.clamp(positions.long() + 1, min=original)  # [n]
    base = rope.theta * ((rope.factor * lengths / original) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    grown = 1.0 / (base[:, None] ** _exponents(head_dim)[None, :])  # [n, head_dim // 2]
    inv_freq = torch.where((lengths > original)[:, None], grown, rope_inv_freq(head_dim, rope)[None, :])
    return positions.float()[:, None] * inv_freq


def rope_freqs(head_dim: int, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    """The angle of every position and frequency: [max_positions, head_dim // 2]."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if rope.rope_type == "dynamic":
        return _dynamic_freqs(head_dim, rope, positions)
    return torch.outer(positions, rope_inv_freq(head_dim, rope))  # [max_positions, head_dim // 2]


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        freqs = rope_freqs(head_dim, rope, max_positions)  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)  # rotate-half's sign folded in
        scale = rope.attention_factor   # yarn, longrope: cos and sin scaled, as transformers does
        self.register_buffer("cos", emb.cos() * scale if scale != 1.0 else emb.cos(), persistent=False)
        self.register_buffer("sin", signed_sin * scale if scale != 1.0 else signed_sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        return cos, sin
