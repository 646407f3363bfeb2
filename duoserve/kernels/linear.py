"""Linear and embedding backends for the CPU, swapped for the model's plain ``nn.Linear`` at the edge.

``replace_linears(model, factory)`` puts ``factory(linear)`` where each ``nn.Linear`` was, as
gpt-fast quantizes a plain model from outside: ``cpu_linear`` (the dense kernels of
``duoserve.kernels.dense`` over the same weight, packed where the CPU allows) or ``int8_linear``
(per-channel int8, ``--quantization int8``). The GGUF block modules (``GGUFLinear``,
``GGUFEmbedding``) are built by the loader where a dense parameter would go, so the dense
weight never exists. Each module's forward is one op of ``duoserve.kernels.ops``, opaque to
``torch.compile``. ``weight_kind`` names a module's weights in the memory report.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from duoserve.kernels.dense import PACK_COLUMNS, pack_linear_weight
from duoserve.kernels.gguf import INTERLEAVED, Blocks, gguf_embedding, interleave, release_file_pages, type_id
from duoserve.kernels.ops import define_ops


def replace_linears(model: nn.Module, factory: Callable[[nn.Linear], nn.Module | None]) -> int:
    """Put ``factory(linear)`` in place of every ``nn.Linear`` of ``model`` where it returns a module
    (None keeps the layer); returns how many were replaced."""
    # parents and names only: a replaced layer's plain weight is freed before the next one is
    # built (its memory reused for the next copy), so this never holds both copies of every layer
    targets = [(module, name) for module in model.modules() for name, child in module.named_children()
               if isinstance(child, nn.Linear)]
    count = 0
    for module, name in targets:
        linear = getattr(module, name)
        replacement = factory(linear)
        if replacement is not None:
            setattr(module, name, replacement)
            count += 1
        del linear, replacement
    return count


class CPULinear(nn.Module):
    """y = x @ W^T (+ b). Where ``csrc/packed_linear.c`` serves the CPU and dtype, over W packed
    once for it, any number of rows (op ``duoserve::packed_linear``); otherwise the small-row C
    kernel for a few rows and oneDNN's GEMM for more (op ``duoserve::linear``).

    A packed layer keeps only the packed copy (the plain one is freed with the module it
    replaces); a tied output projection's embedding reads its rows from it (``PackedEmbedding``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_linear_weight(weight.detach())
        # plain: shared with the module it replaces, never copied
        self.weight = weight.detach() if self.packed is None else None
        self.bias = None if bias is None else bias.detach()
        define_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.duoserve.packed_linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.duoserve.linear(x, self.weight, self.bias)


def cpu_linear(linear: nn.Linear) -> CPULinear | None:
    """A ``CPULinear`` over ``linear``'s weight, or None where the CPU kernels do not take it."""
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return CPULinear(weight, linear.bias)


class PackedEmbedding(nn.Module):
    """A tied embedding table's rows read from its output projection's packed copy, so that the
    plain table need not stay beside it: row t sits in block t // 48 at column t % 48, its
    values k apart (float32) or in pairs (bfloat16), as ``csrc/packed_linear.c`` packs them."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.packed, self.num_embeddings, self.embedding_dim = packed, num_embeddings, embedding_dim

    @classmethod
    def of_head(cls, head: CPULinear) -> "PackedEmbedding":
        """A tied table's rows, read from its output projection's packed copy."""
        return cls(head.packed, head.out_features, head.in_features)

    @classmethod
    def of_table(cls, table: torch.Tensor) -> "PackedEmbedding | None":
        """An untied embedding table packed as a linear weight would be (the C++ decode step reads
        its rows so), or None where the CPU has no packed kernel for its dtype."""
        packed = pack_linear_weight(table.detach())
        return None if packed is None else cls(packed, *table.shape)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        block, column, k = ids // PACK_COLUMNS, ids % PACK_COLUMNS, self.embedding_dim
        if self.packed.dtype == torch.bfloat16:
            table = self.packed.view(-1, k // 2, PACK_COLUMNS, 2)
            return table[block, :, column, :].reshape(*ids.shape, k)
        return self.packed.view(-1, k, PACK_COLUMNS)[block, :, column]


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ b) with W kept as GGUF blocks (op ``duoserve::gguf_linear``). A fused
    projection (Q/K/V, gate/up) whose parts come in different block types keeps one block weight
    per type run, outputs joined. In fast mode a run of a 32-value block type (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0) of a multiple of 16 rows is repacked once, its rows interleaved sixteen to a group
    (``csrc/gguf_interleaved.h``: the same bytes, a block's float steps shared by 16 rows); ``parts``
    then holds the repacked bytes, which only its run's type id reads right."""

    weight_kind = "packed blocks"

    def __init__(self, parts: list[Blocks], bias: torch.Tensor | None, mode: str) -> None:
        super().__init__()
        merged = _merge_same_type(parts)
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.bias = bias
        self.mode = mode
        define_ops()
        # (buffer name, type id, columns) of each run: buffers move and count with the module
        self.runs, self.parts = [], []
        for i, part in enumerate(merged):
            data, type_ = part.data, type_id(part)
            repacked = interleave(data, type_, part.cols) if mode == "fast" and data.device.type == "cpu" else None
            if repacked is not None:
                release_file_pages(data)
                data, type_ = repacked, type_ | INTERLEAVED
            self.runs.append((f"blocks_{i}", type_, part.cols))
            self.parts.append(dataclasses.replace(part, data=data))
            self.register_buffer(f"blocks_{i}", data, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [torch.ops.duoserve.gguf_linear(x, getattr(self, name), type_id, cols, self.mode)
                for name, type_id, cols in self.runs]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        types = "+".join(p.type_name for p in self.parts)
        return f"in={self.in_features}, out={self.out_features}, blocks={types}, mode={self.mode}"


def _merge_same_type(parts: list[Blocks]) -> list[Blocks]:
    merged: list[Blocks] = []
    for part in parts:
        if merged and merged[-1].type_name == part.type_name:
            last = merged[-1]
            merged[-1] = dataclasses.replace(last, data=torch.cat([last.data, part.data]), rows=last.rows + part.rows)
        else:
            merged.append(part)
    return merged


class GGUFEmbedding(nn.Module):
    """Token embeddings read from GGUF blocks: only the rows of the step's tokens are dequantized."""

    weight_kind = "embedding"

    def __init__(self, weight: Blocks, dtype: torch.dtype, type_id_: int | None = None) -> None:
        """``type_id_``: the id of ``weight.data``'s layout where it is not the file's (interleaved)."""
        super().__init__()
        self.type_id, self.cols, self.dtype = type_id(weight) if type_id_ is None else type_id_, weight.cols, dtype
        self.register_buffer("blocks", weight.data, persistent=False)
        define_ops()

    @classmethod
    def reading_head(cls, head: nn.Module, dtype: torch.dtype) -> "GGUFEmbedding | None":
        """A tied table read from its output projection's blocks where fast mode repacked them (one
        copy of the table, not two), else None."""
        if not isinstance(head, GGUFLinear) or len(head.runs) != 1 or not head.runs[0][1] & INTERLEAVED:
            return None
        return cls(head.parts[0], dtype, head.runs[0][1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.duoserve.gguf_embedding(ids, self.blocks, self.type_id, self.cols, self.dtype)
        return gguf_embedding(ids, self.blocks, self.type_id, self.cols, self.dtype)


class Int8Linear(nn.Module):
    """y = x @ W^T (+ b) with W stored as int8 per output channel (``scale = max|row| / 127``),
    multiplied by torch's int8-weight kernel (``aten._weight_int8pack_mm``)."""

    weight_kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(weight.dtype))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales.to(flat.dtype))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def int8_linear(linear: nn.Linear) -> Int8Linear:
    """``linear`` quantized to int8 per output channel (a tied output projection gets its own copy)."""
    return Int8Linear(linear.weight, linear.bias)
