"""A GGUF file's header: its metadata, and where each tensor's bytes lie (memory-mapped, not read).

The ``gguf`` package's ``GGUFReader`` makes a numpy view of every element of every metadata
array, so a file with a large vocabulary takes seconds to open (BENCHMARKS.md, "Start-up");
this reads the same header with ``struct``, one Python object per value. The layout is
llama.cpp's (GGUF v2/v3): magic, version, tensor and key counts, the key/value pairs, the tensor
infos, then the tensors' data from the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value type -> struct format of a scalar of it
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it: the row length first
    data: np.ndarray        # its bytes (uint8, a read-only view of the map)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


@dataclass
class GGUFFile:
    meta: dict[str, Any]   # key -> value (str, int, float, bool, or a list of them)
    tensors: list[GGUFTensor]


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.at = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        text = bytes(self.buffer[self.at:self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def strings(self, count: int) -> list[str]:
        """``count`` strings in one loop (a vocabulary's 262,144 tokens: half the time of string())."""
        unpack, buffer, at, out = _U64.unpack_from, self.buffer, self.at, []
        append = out.append
        for _ in range(count):
            (size,) = unpack(buffer, at)
            append(str(buffer[at + 8:at + 8 + size], "utf-8", "replace"))
            at += 8 + size
        if at > len(buffer):
            raise struct.error(f"a string runs past the end of the file (at byte {at})")
        self.at = at
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return self.strings(count)
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            values = np.frombuffer(self.buffer, dtype=_NUMPY[item], count=count, offset=self.at)
            self.at += values.nbytes
            return values.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.at}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: Path | str) -> GGUFFile:
    """The header of the GGUF file at ``path``; tensors' data stay in the (read-only) map.
    Raises ValueError for a file that is not GGUF v2/v3 or is cut short."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buffer = memoryview(mapped)
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic at the start of the file")
    cursor = _Cursor(buffer)
    cursor.at = 4
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 and 3 are read)")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    meta = {}
    try:
        for _ in range(kv_count):
            key = cursor.string()
            meta[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            infos.append((name, GGMLQuantizationType(cursor.scalar("<I")), dims, cursor.scalar("<Q")))
    except struct.error as exc:
        raise ValueError(f"the header ends early: {exc}") from exc
    alignment = int(meta.get("general.alignment", 32))
    start = -(-cursor.at // alignment) * alignment
    data = np.frombuffer(mapped, dtype=np.uint8)
    tensors = []
    for name, kind, dims, offset in infos:
        if kind not in GGML_QUANT_SIZES:
            raise ValueError(f"tensor {name} has type {kind.name}, whose block size the gguf package does not know")
        block_values, block_bytes = GGML_QUANT_SIZES[kind]
        size = int(np.prod(dims)) // block_values * block_bytes
        if start + offset + size > data.size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors.append(GGUFTensor(name, kind, dims, data[start + offset: start + offset + size]))
    return GGUFFile(meta, tensors)
