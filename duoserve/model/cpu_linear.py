"""CPU matmuls through oneDNN with pre-packed weights.

On this kind of CPU a ``Linear`` whose weight is reordered once into oneDNN's
blocked layout runs about twice as fast as ``F.linear`` over the plain weight, at
the small batch sizes of decoding (measured in BENCHMARKS.md). The model code keeps
plain ``nn.Linear``; the runner swaps them here, at the edge, after loading.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a dense [out, in] weight into oneDNN's layout (an opaque mkldnn tensor)."""
    return weight.detach().to_mkldnn()


class PackedLinear(nn.Module):
    """y = x @ W^T (+ b) with W held in oneDNN's layout; input and output are dense tensors."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_for_cpu(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a ``PackedLinear`` (and pack a tied output
    projection beside the embedding table); returns how many matmuls were packed."""
    if not onednn_available():
        logger.info("oneDNN is not available: CPU matmuls use plain F.linear")
        return 0
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and _packable(child.weight):
                setattr(module, child_name, PackedLinear(child.weight, child.bias))
                count += 1
    embed = getattr(model, "embed", None)
    if getattr(model, "tied_head", False) is None and embed is not None and _packable(embed.weight):
        model.tied_head = PackedLinear(embed.weight, None)
        count += 1
    release_free_memory()
    return count


def release_free_memory() -> None:
    """Hand memory freed by the swap back to the OS (glibc keeps freed heap pages otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
