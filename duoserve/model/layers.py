"""Small building blocks of the decoder: RMSNorm, applying rotary position embeddings (their tables
are rope.py's), SiLU-and-multiply
(and Gemma's variants: RMSNorm scaled by 1 + weight, tanh-GELU-and-multiply).

Each piece of arithmetic between the linears is a module (``RMSNorm``, ``Rotary``,
``SiluAndMul``), so the runner can put an op in its place at the edge (``worker/backends.py``:
one op call in eager and compiled steps alike, so both compute the same bits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the model dtype, as Hugging Face does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dimension, in float32 whatever ``x``'s dtype, then scaled by ``weight`` in
    ``x``'s dtype (Hugging Face's order of roundings)."""
    if x.dtype == torch.float32:  # one fused kernel; same arithmetic as below
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the normalized value times (1 + weight), both in float32, then rounded to
    ``x``'s dtype (Hugging Face's Gemma3RMSNorm; ``weight`` is stored as the checkpoint has it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos: [num_tokens, 1, head_dim]; sin likewise, with
    its first half negated (``RotaryEmbedding.cos_sin``), so rotate-half is a swap of halves."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)  # [num_tokens, num_heads, head_dim]
    return torch.addcmul(x * cos, swapped, sin)


class Rotary(nn.Module):
    """``apply_rotary`` as a module (no state)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * intermediate], gate first -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, intermediate]
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """``silu_mul`` as a module (no state)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


class GeluTanhAndMul(nn.Module):
    """gate_up: [num_tokens, 2 * intermediate], gate first -> gelu_tanh(gate) * up (Gemma's MLP)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gate_activation(hidden_act: str) -> nn.Module:
    """The MLP's gate-and-multiply for ``ModelArch.hidden_act``."""
    return SiluAndMul() if hidden_act == "silu" else GeluTanhAndMul()
