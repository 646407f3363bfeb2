"""The small ops between a layer's linears as op calls: RMSNorm, rotary, SiLU-and-multiply
(and Gemma's: its (1 + weight) RMSNorm, tanh-GELU-and-multiply; a mixture of experts' routing
and the sums of its experts' outputs).

``duoserve::rms_norm``, ``duoserve::rotary`` and ``duoserve::silu_mul`` (defined in
``duoserve.kernels.ops``) have C++ kernels only (``csrc/cpu_ops.cpp``), over the functions of
``csrc/glue.c`` that the C++ decode step (``csrc/decode_step.c``) calls too. The runner puts
``OpRMSNorm``, ``OpRotary`` and ``OpSiluAndMul`` in place of the model's own modules
(``duoserve.model.layers``) on the CPU (``worker/backends.py``), so eager, compiled and native
decode steps compute a row to the same bits. Traced into, Inductor would fuse them into loops of
its own, with another order of sums, fused multiply-adds and bf16 intermediates kept in float:
the last bits would move, and where activations are quantized (the GGUF fast mode) a moved bit
can move a rounding, and then a token. Without the C++ build (hence without a compiler, and
without a compiled or native step) the model's modules stay.
"""

from __future__ import annotations

import torch
from torch import nn

from duoserve.kernels.ops import define_ops


def glue_ops_available() -> bool:
    """Whether the ops have their C++ kernels (csrc/cpu_ops.cpp built)."""
    define_ops()
    return torch._C._dispatch_has_kernel_for_dispatch_key("duoserve::rms_norm", "CPU")


class OpRMSNorm(nn.Module):
    """An RMSNorm module's op: its weight (the same parameter) and epsilon."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.rms_norm(x, self.weight, self.eps)


class OpOffsetRMSNorm(OpRMSNorm):
    """Gemma's RMSNorm (times 1 + weight) as its op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.offset_rms_norm(x, self.weight, self.eps)


class OpRotary(nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.rotary(x, cos, sin)


class OpSiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.silu_mul(gate_up)


class OpGeluTanhAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.gelu_tanh_mul(gate_up)


class OpTopKRouting(nn.Module):
    """A mixture of experts' routing as its op (csrc/glue.c's, the C++ decode step's too)."""

    def __init__(self, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.duoserve.moe_route(logits, self.top_k, self.renormalize)


class OpExpertSum(nn.Module):
    def forward(self, out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> None:
        torch.ops.duoserve.expert_add(out, rows, y, weights)


class OpSharedExpertAdd(nn.Module):
    def forward(self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.shared_expert_add(out, gate, shared)
