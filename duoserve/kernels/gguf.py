"""Kernels that compute from GGUF's quantized blocks (``csrc/gguf_linear.c``).

A weight of one of GGUF's quantized types (``BLOCK_TYPES``, Q4_0 to Q6_K) stays as its raw blocks
(the bytes of the file, a sixth to a half of bf16's):

every row count, a decode step's few rows as a prompt's hundreds, goes straight through the
blocks, with one arithmetic per mode so that a row's result never depends on its batch, its chunk
or which of its neighbours were cached:

* ``fast``: the rows quantized to 8 bits per block of 32 (per super-block of 256 for the K-quants,
  whose sub-blocks' integer scales then apply to integer sums) and integer dot products, as
  llama.cpp computes; with many rows each tile of weight rows is decoded once and held against them all;
* ``exact``: each block widened to float32 in registers (the dequantized model's result up to
  summation order).

``gguf_linear`` is the Python kernel of the op ``duoserve::gguf_linear``; where a C++ compiler is
found the op's kernel is ``csrc/cpu_ops.cpp`` instead, the same computation without Python
between the dispatcher and the C code.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Protocol

import torch

from duoserve.gguf_types import block_types
from duoserve.kernels.build import load_c_function

# GGUF type name -> its row of csrc/gguf_blocks.h's table (id in gguf_linear.c, values and bytes per block, ...)
BLOCK_TYPES = block_types()

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class Blocks(Protocol):
    """A [rows, cols] weight as GGUF blocks, as the GGUF loader reads it: ``data`` is [rows, bytes
    per row] uint8 and ``type_name`` one of ``BLOCK_TYPES``."""
    data: torch.Tensor
    type_name: str
    rows: int
    cols: int


_KERNELS: dict = {}  # filled by gguf_kernels(): name -> ctypes function (read on every call, so kept flat)


def gguf_kernels() -> dict | None:
    """The C functions of gguf_linear.c, or None without a compiler (or DUOSERVE_C_KERNELS=0)."""
    if not _KERNELS:
        kernels = gguf_kernels_for("native")
        if kernels is None:
            return None
        _KERNELS.update(kernels)
    return _KERNELS


def gguf_kernels_for(march: str) -> dict | None:
    """gguf_linear.c's functions built for the instruction set ``march`` (build.c_flags): the
    kernels use ``native``; the tests also build the AVX2 and portable paths."""
    dequant = load_c_function("gguf_linear", "gguf_dequantize", (_P, _I, _L, _I, _P, _L, _P, _I, _I), march=march)
    if dequant is None:
        return None
    matmul = (_P, _P, _I, _I, _I, _I, _P, _I, _I)
    return dict(dequantize=dequant, fast=load_c_function("gguf_linear", "gguf_linear_fast", matmul, march=march),
                exact=load_c_function("gguf_linear", "gguf_linear_exact", matmul, march=march),
                takes_superblock_rows=load_c_function("gguf_linear", "gguf_takes_superblock_rows", (_I,), march=march),
                interleave=load_c_function("gguf_linear", "gguf_interleave", (_P, _I, _L, _I, _P, _I), march=march),
                row_bytes=load_c_function("gguf_linear", "gguf_row_bytes", (_I, _I), restype=_L, march=march))


def activation_block(type_name: str) -> int:
    """How many values of x share one 8-bit scale when fast mode computes a weight of ``type_name``:
    256 for the types gguf_linear.c takes a super-block at a time (the K-quants), else 32."""
    takes = (_KERNELS or gguf_kernels())["takes_superblock_rows"]
    return 256 if takes(BLOCK_TYPES[type_name].id) else 32


INTERLEAVED = 16   # a type id's flag: the rows repacked sixteen to a group (csrc/gguf_interleaved.h)


def interleave(data: torch.Tensor, type_id: int, cols: int, kernels: dict | None = None) -> torch.Tensor | None:
    """Blocks ``data`` [rows, bytes per row] of ``type_id`` repacked for fast mode, sixteen rows to a
    group (type id ``type_id | INTERLEAVED``; the same bytes, but Q4_K's 148 a block for 144), or
    None where the type or the row count does not allow it (Q2_K, Q3_K, Q5_K; rows not a multiple
    of 16)."""
    fns = kernels or _KERNELS or gguf_kernels()
    row_bytes = fns["row_bytes"](type_id | INTERLEAVED, cols)
    if row_bytes < 0 or data.shape[0] % 16:
        return None
    out = torch.empty(data.shape[0], row_bytes, dtype=torch.uint8)
    if fns["interleave"](data.data_ptr(), type_id, data.shape[0], cols, out.data_ptr(), torch.get_num_threads()) < 0:
        return None
    return out


def release_file_pages(data: torch.Tensor) -> None:
    """Unmap from this process the whole pages under ``data`` where they are a file's (a GGUF
    file's blocks, once repacked into a copy): they leave its resident set and stay in the page
    cache, read from the file again if anything touches them. Anonymous memory is left alone (its
    pages would come back zeroed)."""
    page = mmap.PAGESIZE
    start, end = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first or not _file_backed(start, end):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(first, last - first, mmap.MADV_DONTNEED)


def _file_backed(start: int, end: int) -> bool:
    """Whether [start, end) lies in one mapping of a file (/proc/self/maps: a non-zero inode)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                low, high = (int(a, 16) for a in fields[0].split("-"))
                if low <= start < high:
                    return end <= high and len(fields) >= 6 and fields[4] != "0"
    except OSError:
        pass
    return False


def type_id(weight: Blocks) -> int:
    return BLOCK_TYPES[weight.type_name].id


def _dequantize(data: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype, ids: torch.Tensor | None,
                out: torch.Tensor | None) -> torch.Tensor:
    """Rows ``ids`` (all of ``data``'s without) as a dense [rows, cols] tensor of ``dtype``."""
    fn = (_KERNELS or gguf_kernels())["dequantize"]
    count = data.shape[0] if ids is None else ids.numel()
    if out is None:
        out = torch.empty(count, cols, dtype=dtype)
    ids64 = None if ids is None else ids.to(torch.int64).contiguous()
    fn(data.data_ptr(), type_id, data.shape[0], cols, None if ids64 is None else ids64.data_ptr(),
       count, out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def dequantize_rows(weight: Blocks, dtype: torch.dtype, ids: torch.Tensor | None = None,
                    start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (or ``start:stop``) of a block weight as a dense [rows, cols] tensor of ``dtype``
    (float32 or bfloat16)."""
    data = weight.data[start:stop] if ids is None else weight.data
    return _dequantize(data, type_id(weight), weight.cols, dtype, ids, out)


def gguf_linear(x: torch.Tensor, data: torch.Tensor, type_id: int, cols: int, mode: str) -> torch.Tensor:
    """x [..., cols] @ W^T for W given as GGUF blocks ``data`` [rows, bytes per row]; x's dtype out.
    Every row count runs the same kernel, so a row's result does not depend on its batch. Runs
    once per linear layer and step: kept to the fewest torch calls."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        return gguf_linear(x.float().contiguous(), data, type_id, cols, mode).to(x.dtype)
    y = x.new_empty((*x.shape[:-1], data.shape[0]))
    status = (_KERNELS or gguf_kernels())[mode](x.data_ptr(), data.data_ptr(), type_id, x.numel() // cols,
                                                data.shape[0], cols, y.data_ptr(), x.dtype == torch.bfloat16,
                                                torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"gguf_linear: kernel error {status}")
    return y


def gguf_embedding(ids: torch.Tensor, data: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` of an embedding table given as GGUF blocks: -> [*ids.shape, cols] of ``dtype``."""
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    return _dequantize(data, type_id, cols, out_dtype, ids.reshape(-1), None).to(dtype).view(*ids.shape, cols)
