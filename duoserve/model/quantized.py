"""Linear layers and embeddings that keep GGUF's quantized blocks in memory and compute from them.

``--quantization gguf`` leaves each Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensor of a GGUF file as
its raw blocks (the bytes of the file, a quarter to a half of bf16's) and runs
``csrc/gguf_linear.c`` on them:

* a decode step's few rows (up to ``DIRECT_ROWS``) go straight through the blocks: in
  ``fast`` mode with the rows quantized to 8 bits per block of 32 and integer dot
  products (VNNI), as llama.cpp does; in ``exact`` mode with each block widened to float32
  in registers (the dequantized model's result up to summation order);
* more rows (prefill, large batches) dequantize the weight, a slice of rows at a time,
  into a small buffer in the engine dtype and multiply with oneDNN's GEMM: the buffer
  stays in cache, so the cost over a dense weight is one pass over the packed bytes.

Both are ``packed_linear`` here, the Python kernel of the op ``duoserve::gguf_linear``;
where a C++ compiler is found the op's kernel is ``csrc/cpu_ops.cpp`` instead, the same
computation without Python between the dispatcher and the C code.

``--quantization int8`` quantizes any checkpoint's linear weights per output channel at
load and multiplies with torch's own int8-weight kernel. Without a C compiler a GGUF
model is dequantized at load instead, with one log line.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from duoserve.model.cpu_kernels import _load
from duoserve.model.cpu_linear import linear_any_m

# GGUF type name -> (id in gguf_linear.c, values per block, bytes per block)
BLOCK_TYPES = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q8_0": (2, 32, 34),
               "Q4_K": (3, 256, 144), "Q5_K": (4, 256, 176), "Q6_K": (5, 256, 210)}
DIRECT_ROWS = 8             # rows computed straight from the blocks; more: dequantize + GEMM (measured)
SLICE_VALUES = 1 << 21      # weight values dequantized at a time for the GEMM path (4 MB bf16)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


_KERNELS: dict = {}  # filled by kernels(): name -> ctypes function (read on every call, so kept flat)


def kernels() -> dict | None:
    """The C functions of gguf_linear.c, or None without a compiler (or DUOSERVE_C_KERNELS=0)."""
    if not _KERNELS:
        dequant = _load("gguf_linear", "gguf_dequantize", (_P, _I, _L, _I, _P, _L, _P, _I, _I))
        if dequant is None:
            return None
        matmul = (_P, _P, _I, _I, _I, _I, _P, _I, _I)
        _KERNELS.update(dequantize=dequant, fast=_load("gguf_linear", "gguf_linear_fast", matmul),
                        exact=_load("gguf_linear", "gguf_linear_exact", matmul))
    return _KERNELS


@dataclass
class PackedWeight:
    """A [rows, cols] weight as GGUF blocks: ``data`` is [rows, bytes per row] uint8."""
    data: torch.Tensor
    type_name: str
    rows: int
    cols: int

    @property
    def type_id(self) -> int:
        return BLOCK_TYPES[self.type_name][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def dequantize_rows(weight: PackedWeight, dtype: torch.dtype, ids: torch.Tensor | None = None,
                    start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (or ``start:stop``) of a packed weight as a dense [rows, cols] tensor of ``dtype``
    (float32 or bfloat16)."""
    fn = (_KERNELS or kernels())["dequantize"]
    data = weight.data[start:stop] if ids is None else weight.data
    count = data.shape[0] if ids is None else ids.numel()
    if out is None:
        out = torch.empty(count, weight.cols, dtype=dtype)
    ids64 = None if ids is None else ids.to(torch.int64).contiguous()
    fn(data.data_ptr(), weight.type_id, data.shape[0], weight.cols, None if ids64 is None else ids64.data_ptr(),
       count, out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def packed_linear(x: torch.Tensor, data: torch.Tensor, type_id: int, cols: int, mode: str) -> torch.Tensor:
    """x [..., cols] @ W^T for W given as GGUF blocks ``data`` [rows, bytes per row]; x's dtype out.
    The few-row path runs once per linear layer and decode step: kept to the fewest torch calls."""
    rows_out = data.shape[0]
    m = x.numel() // cols
    if m <= DIRECT_ROWS:
        if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
            return packed_linear(x.float().contiguous(), data, type_id, cols, mode).to(x.dtype)
        y = x.new_empty((*x.shape[:-1], rows_out))
        (_KERNELS or kernels())[mode](x.data_ptr(), data.data_ptr(), type_id, m, rows_out, cols, y.data_ptr(),
                                      x.dtype == torch.bfloat16, torch.get_num_threads())
        return y
    flat = x.reshape(-1, cols)
    weight = PackedWeight(data, _TYPE_NAMES[type_id], rows_out, cols)
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    flat = flat.to(dtype)
    step = max(1, SLICE_VALUES // cols)
    buffer = _scratch(dtype, min(step, rows_out) * cols)
    if step >= rows_out:  # one slice: no copy of the output
        dense = dequantize_rows(weight, dtype, out=buffer[: rows_out * cols].view(rows_out, cols))
        y = linear_any_m(flat, dense, None)
    else:
        y = torch.empty(m, rows_out, dtype=dtype)
        for start in range(0, rows_out, step):
            stop = min(start + step, rows_out)
            dense = buffer[: (stop - start) * cols].view(stop - start, cols)
            y[:, start:stop] = linear_any_m(flat, dequantize_rows(weight, dtype, start=start, stop=stop, out=dense), None)
    return y.to(x.dtype).view(*x.shape[:-1], rows_out)


_TYPE_NAMES = {type_id: name for name, (type_id, _, _) in BLOCK_TYPES.items()}


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}  # one reused buffer per dtype (one step at a time)


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The buffer for dequantized slices of ``dtype``, grown to at least ``numel`` values."""
    if dtype not in _SCRATCH or _SCRATCH[dtype].numel() < numel:
        _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return _SCRATCH[dtype]


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ b) with W kept as GGUF blocks. A fused projection (Q/K/V, gate/up) whose
    parts come in different block types keeps one packed weight per type run, outputs joined."""

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None, mode: str) -> None:
        super().__init__()
        self.parts = _merge_same_type(parts)
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.bias = bias
        self.mode = mode
        from duoserve.model.custom_ops import define_ops

        define_ops()  # duoserve::gguf_linear: the C++ kernel where it builds, else packed_linear
        # (buffer name, type id, columns) of each packed run: buffers move and count with the module
        self.runs = [(f"packed_{i}", part.type_id, part.cols) for i, part in enumerate(self.parts)]
        for (name, _, _), part in zip(self.runs, self.parts):
            self.register_buffer(name, part.data, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [torch.ops.duoserve.gguf_linear(x, getattr(self, name), type_id, cols, self.mode)
                for name, type_id, cols in self.runs]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        types = "+".join(p.type_name for p in self.parts)
        return f"in={self.in_features}, out={self.out_features}, blocks={types}, mode={self.mode}"


def _merge_same_type(parts: list[PackedWeight]) -> list[PackedWeight]:
    merged: list[PackedWeight] = []
    for part in parts:
        if merged and merged[-1].type_name == part.type_name:
            last = merged[-1]
            merged[-1] = PackedWeight(torch.cat([last.data, part.data]), part.type_name, last.rows + part.rows, part.cols)
        else:
            merged.append(part)
    return merged


class GGUFEmbedding(nn.Module):
    """Token embeddings read from GGUF blocks: only the rows of the step's tokens are dequantized."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = weight
        self.dtype = dtype
        self.register_buffer("blocks", weight.data, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.duoserve.gguf_embedding(ids, self.blocks, self.packed.type_id, self.packed.cols,
                                                     self.dtype)
        return gguf_embedding(ids, self.blocks, self.packed.type_id, self.packed.cols, self.dtype)


def gguf_embedding(ids: torch.Tensor, data: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    weight = PackedWeight(data, _TYPE_NAMES[type_id], data.shape[0], cols)
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    return dequantize_rows(weight, out_dtype, ids=ids.reshape(-1)).to(dtype).view(*ids.shape, cols)


class Int8Linear(nn.Module):
    """y = x @ W^T (+ b) with W stored as int8 per output channel (``scale = max|row| / 127``),
    multiplied by torch's int8-weight kernel (``aten._weight_int8pack_mm``)."""

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


def use_int8_linears(model: nn.Module) -> int:
    """Quantize every ``nn.Linear`` (and a tied output projection, as its own int8 copy) of a CPU
    model; returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias))
                count += 1
    if getattr(model, "arch", None) is not None and model.arch.tie_word_embeddings and model.tied_head is None:
        model.tied_head = Int8Linear(model.embed.weight, None)
        count += 1
    return count
