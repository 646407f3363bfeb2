"""CPU linear layers: the fastest kernel for each batch size, over one copy of the weights.

Measured on the project's machine (BENCHMARKS.md): for a decode step of one to a few
sequences a linear layer is bound by the bytes of its weights, and ``csrc/small_m_linear.c``
streams them at close to the memory bandwidth (oneDNN reached 60-85 % of it); from about
eight rows on, oneDNN's GEMM (``mkldnn._linear_pointwise`` over the plain weight, as fast
here as over a pre-packed copy) wins by far. Both read the same dense weight, so nothing is
copied: a tied output projection is the embedding table itself. The model code keeps
plain ``nn.Linear``; the runner swaps them here, at the edge, after loading.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from duoserve.model.cpu_kernels import c_small_m_linear

logger = logging.getLogger(__name__)

# the most rows the bandwidth-bound kernel takes, by weight dtype: measured crossovers with oneDNN
# on whole SmolLM2-135M steps (fp32 5 and 6 rows 20.6 / 21.8 ms vs 23.9 / 24.8, 7 rows 25.9 vs 25.8;
# bf16 3 and 4 rows 11.3 / 12.7 vs 13.1 / 13.4, 5 rows 16.6 vs 14.7): a speculating request's
# 1 + k tokens and a handful of decodes stay on it
SMALL_M = {torch.float32: 6, torch.bfloat16: 4}


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_any_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias), with the kernel that suits the number of rows."""
    rows = x.reshape(-1, weight.shape[1])  # [m, in]
    if rows.shape[0] <= SMALL_M.get(weight.dtype, 0) and x.dtype == weight.dtype:
        out = c_small_m_linear(rows, weight, bias)
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class CPULinear(nn.Module):
    """y = x @ W^T (+ b): the small-row C kernel for a few rows, oneDNN's GEMM for more, as the op
    ``duoserve::linear`` (``duoserve.model.custom_ops``): opaque inside a compiled graph, with a C++
    kernel (``csrc/cpu_ops.cpp``) where one builds and ``linear_any_m`` otherwise."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()      # shared with the module it replaces, never copied
        self.bias = None if bias is None else bias.detach()
        from duoserve.model.custom_ops import define_ops

        define_ops()  # duoserve::linear: the C++ kernel where it builds, else linear_any_m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.linear(x, self.weight, self.bias)


def use_cpu_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a ``CPULinear`` over the same weight (and give a
    tied output projection one over the embedding table); returns how many were replaced."""
    if not onednn_available():
        logger.info("oneDNN is not available: CPU matmuls use plain F.linear")
        return 0
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and _supported(child.weight):
                setattr(module, child_name, CPULinear(child.weight, child.bias))
                count += 1
    embed = getattr(model, "embed", None)
    if getattr(model, "tied_head", False) is None and isinstance(embed, nn.Embedding) and _supported(embed.weight):
        model.tied_head = CPULinear(embed.weight, None)
        count += 1
    release_free_memory()
    return count


def release_free_memory() -> None:
    """Hand freed memory back to the OS (glibc keeps freed heap pages otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
