"""CPU linear layers: the fastest kernel for each batch size, over one copy of the weights.

Measured on the project's machine (BENCHMARKS.md): where the CPU has AVX-512 (float32) or
AVX512-BF16 (bfloat16), ``csrc/packed_linear.c`` over a weight repacked once at load beats
oneDNN's GEMM over the plain weight at every row count this model sees (1.2-3x a step's
linears from 1 to 64 rows, 6-18 % at a 512-token chunk), so it serves them all and the plain
copy is dropped. Elsewhere: for a decode step of one to a few sequences a linear layer is
bound by the bytes of its weights, and ``csrc/small_m_linear.c`` streams them at close to
the memory bandwidth; from about eight rows on, oneDNN's GEMM (``mkldnn._linear_pointwise``
over the plain weight) wins by far; both read the same weight, and a tied output projection
is the embedding table itself. The model code keeps plain ``nn.Linear``; the runner swaps
them here, at the edge, after loading.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from duoserve.model.cpu_kernels import c_small_m_linear, pack_linear_weight

logger = logging.getLogger(__name__)

# the most rows the bandwidth-bound kernel takes, by weight dtype: measured crossovers with oneDNN
# on whole SmolLM2-135M steps (fp32 5 and 6 rows 20.6 / 21.8 ms vs 23.9 / 24.8, 7 rows 25.9 vs 25.8;
# bf16 3 and 4 rows 11.3 / 12.7 vs 13.1 / 13.4, 5 rows 16.6 vs 14.7): a speculating request's
# 1 + k tokens and a handful of decodes stay on it
SMALL_M = {torch.float32: 6, torch.bfloat16: 4}

PACK_COLUMNS = 48   # output columns of a block of a packed weight: NB in csrc/packed_linear.c


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
    """y = x @ W^T (+ b). Where ``csrc/packed_linear.c`` serves the CPU and dtype, over W packed
    once for it, any number of rows (op ``duoserve::packed_linear``); otherwise the small-row C
    kernel for a few rows and oneDNN's GEMM for more (op ``duoserve::linear``). Both ops are
    opaque inside a compiled graph (``duoserve.model.custom_ops``), with C++ kernels
    (``csrc/cpu_ops.cpp``) where they build and Python ones otherwise.

    A packed layer keeps only the packed copy (the plain one is freed with the module it
    replaces); a tied output projection's embedding reads its rows from it (``PackedEmbedding``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_linear_weight(weight.detach())
        # plain: shared with the module it replaces, never copied
        self.weight = weight.detach() if self.packed is None else None
        self.bias = None if bias is None else bias.detach()
        from duoserve.model.custom_ops import define_ops

        define_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.duoserve.packed_linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.duoserve.linear(x, self.weight, self.bias)


class PackedEmbedding(nn.Module):
    """A tied embedding table's rows read from its output projection's packed copy, so that the
    plain table need not stay beside it: row t sits in block t // 48 at column t % 48, its
    values k apart (float32) or in pairs (bfloat16), as ``csrc/packed_linear.c`` packs them."""

    def __init__(self, head: CPULinear) -> None:
        super().__init__()
        self.packed, self.num_embeddings, self.embedding_dim = head.packed, head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        block, column, k = ids // PACK_COLUMNS, ids % PACK_COLUMNS, self.embedding_dim
        if self.packed.dtype == torch.bfloat16:
            table = self.packed.view(-1, k // 2, PACK_COLUMNS, 2)
            return table[block, :, column, :].reshape(*ids.shape, k)
        return self.packed.view(-1, k, PACK_COLUMNS)[block, :, column]


def use_cpu_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a ``CPULinear`` over the same weight (and give a
    tied output projection one over the embedding table); returns how many were replaced."""
    if not onednn_available():
        logger.info("oneDNN is not available: CPU matmuls use plain F.linear")
        return 0
    # parents and names only: a replaced layer's plain weight is freed before the next one is
    # packed (its memory reused for the next copy), so loading never holds both copies at once
    targets = [(module, name) for module in model.modules() for name, child in module.named_children()
               if isinstance(child, nn.Linear) and _supported(child.weight)]
    for module, name in targets:
        linear = getattr(module, name)
        setattr(module, name, CPULinear(linear.weight, linear.bias))
        del linear
    count = len(targets)
    embed = getattr(model, "embed", None)
    if getattr(model, "tied_head", False) is None and isinstance(embed, nn.Embedding) and _supported(embed.weight):
        model.tied_head = CPULinear(embed.weight, None)
        if model.tied_head.packed is not None:   # one copy of the table: the packed one
            model.embed = PackedEmbedding(model.tied_head)
        count += 1
    del embed
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
