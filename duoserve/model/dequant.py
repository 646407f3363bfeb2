"""Dequantization of GGUF (ggml) tensor types into float32 torch tensors.

Each quantized type packs a fixed number of values (a block) into a fixed number
of bytes. The functions here take the raw bytes as ``[num_blocks, type_size]``
uint8 and return ``[num_blocks, block_values]`` float32; ``dequantize`` handles
the reshaping. The formats are ggml's (see ggml-quants.c), vectorized in torch.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from duoserve.errors import ModelLoadError
from duoserve.gguf_types import block_types


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Read a little-endian float16 at byte ``start`` of every block -> [num_blocks, 1] float32."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (qs & 0x0F).float(), (qs >> 4).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)  # [n, 1]
    q = blocks[:, 2:34].contiguous().view(torch.int8).float()  # [n, 32]
    return d * q


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    low, high = _nibbles(blocks[:, 2:18])  # [n, 16] each
    return d * (torch.cat([low, high], dim=1) - 8.0)  # [n, 32]


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    low, high = _nibbles(blocks[:, 4:20])
    return d * torch.cat([low, high], dim=1) + m  # [n, 32]


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4 bytes qh (bit j: value j's fifth bit) -> [n, 32] of 0 or 16."""
    bits = qh.contiguous().view(torch.int32)  # [n, 1], little-endian like the file
    return (((bits >> torch.arange(32, dtype=torch.int32)) & 1) * 16).float()


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    low, high = _nibbles(blocks[:, 6:22])
    return d * (torch.cat([low, high], dim=1) + _fifth_bits(blocks[:, 2:6]) - 16.0)  # [n, 32]


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    low, high = _nibbles(blocks[:, 8:24])
    return d * (torch.cat([low, high], dim=1) + _fifth_bits(blocks[:, 4:8])) + m  # [n, 32]


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, from 12 bytes -> 2 x [n, 8]."""
    p = packed.long()
    low_sc, low_m = p[:, 0:4] & 63, p[:, 4:8] & 63
    high_sc = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    high_m = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], 1).float(), torch.cat([low_m, high_m], 1).float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])  # [n, 8]
    qs = blocks[:, 16:144].reshape(n, 4, 32)
    low, high = _nibbles(qs)  # [n, 4, 32]
    q = torch.stack([low, high], dim=2).reshape(n, 8, 32)  # sub-block 2i = low, 2i+1 = high
    return (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]  # [n, 8, 32]


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48].long()  # [n, 32]: bit j is the fifth bit of sub-block j
    qs = blocks[:, 48:176].reshape(n, 4, 32)
    low, high = _nibbles(qs)  # [n, 4, 32]
    q = torch.stack([low, high], dim=2).reshape(n, 8, 32)
    bits = torch.arange(8)[None, :, None]
    fifth = ((qh[:, None, :] >> bits) & 1).float() * 16.0  # [n, 8, 32]
    return (d * scales)[:, :, None] * (q + fifth) - (dmin * mins)[:, :, None]


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].long().reshape(n, 2, 64)
    qh = blocks[:, 128:192].long().reshape(n, 2, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(blocks, 208)  # [n, 1]
    # Within each half of 128 values, four runs of 32: low/high nibble of ql[0:32] and ql[32:64],
    # each topped with two bits of qh.
    q = torch.stack([
        (ql[:, :, 0:32] & 0x0F) | (((qh >> 0) & 3) << 4),
        (ql[:, :, 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ], dim=2).float() - 32.0  # [n, 2, 4, 32]
    q = q.reshape(n, 2, 8, 16)  # 16 values per scale
    return d[:, :, None, None] * scales[:, :, :, None] * q  # [n, 2, 8, 16]


def _two_bit_runs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 64 bytes of two-bit values -> [n, 8, 32]: each half of 128 values takes 32 bytes,
    whose bit pairs 0-1, 2-3, 4-5, 6-7 are its four runs of 32."""
    shifts = torch.arange(0, 8, 2).reshape(1, 1, 4, 1)
    return ((qs.long().reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    packed = blocks[:, 0:16].long()  # per 16 values: a four-bit scale (low nibble) and min (high)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scales, mins = d * (packed & 0x0F).float(), dmin * (packed >> 4).float()  # [n, 16]
    q = _two_bit_runs(blocks[:, 16:80]).reshape(n, 16, 16).float()
    return scales[:, :, None] * q - mins[:, :, None]  # [n, 16, 16]


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """The 16 six-bit scales of a Q3_K super-block from 12 bytes -> [n, 16], signed: the low four
    bits are the nibbles of bytes 0-7 (low nibbles first), the top two the bit pairs of bytes 8-11."""
    p = packed.long()
    low = torch.cat([p[:, 0:8] & 0x0F, p[:, 0:8] >> 4], dim=1)
    high = ((p[:, None, 8:12] >> torch.arange(0, 8, 2).reshape(1, 4, 1)) & 3).reshape(-1, 16)
    return (low | (high << 4)) - 32


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 108)
    scales = d * _q3_k_scales(blocks[:, 96:108]).float()  # [n, 16]
    high = (blocks[:, None, 0:32].long() >> torch.arange(8).reshape(1, 8, 1)) & 1  # [n, 8, 32]: bit j of run j
    q = (_two_bit_runs(blocks[:, 32:96]) + 4 * high - 4).reshape(n, 16, 16).float()
    return scales[:, :, None] * q  # [n, 16, 16]


# type name -> its torch dequantizer; the types, their block sizes and the order are the table's
# (duoserve/gguf_types.py, read from csrc/gguf_blocks.h)
_DEQUANTIZERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
                 "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

SUPPORTED_TYPES = ("F32", "F16", "BF16", *sorted(block_types()))


def _by_gguf_package(type_name: str):
    """A dequantizer for a type of the table with none in torch here: the ``gguf`` package's (numpy,
    slower, the same values), so that a new type needs no code in this file to load."""
    qtype = GGMLQuantizationType[type_name]

    def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(blocks.numpy(), qtype), dtype=np.float32))
    return dequantize_blocks


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], name: str = "") -> torch.Tensor:
    """Raw GGUF tensor data -> float32 tensor of ``shape`` (row-major, outermost first); ``name``
    (the tensor's, for errors)."""
    raw = np.array(raw, copy=True)  # mmap-backed GGUF data is read-only; torch wants a writable buffer
    if type_name == "F32":
        return torch.from_numpy(raw.view(np.float32)).reshape(shape)
    if type_name == "F16":
        return torch.from_numpy(raw.view(np.float16)).float().reshape(shape)
    if type_name == "BF16":
        bits = torch.from_numpy(raw.view(np.int16)).reshape(shape)
        return bits.view(torch.bfloat16).float()
    if type_name not in SUPPORTED_TYPES:
        raise ModelLoadError(f"GGUF tensor {name or '?'} has type {type_name}, which is not supported; supported "
                             f"types are {', '.join(SUPPORTED_TYPES)}")
    fn = _DEQUANTIZERS.get(type_name) or _by_gguf_package(type_name)
    blocks = torch.from_numpy(raw.view(np.uint8)).reshape(-1, block_types()[type_name].bytes)
    return fn(blocks).reshape(shape)
