"""GGUF's quantized block types as duoserve computes them, read from their one table:
``GGUF_BLOCK_TYPES`` in ``kernels/csrc/gguf_blocks.h``, where the C kernels read them too.

The kernels' Python side (``kernels/gguf.py``), the model's dequantizers (``model/dequant.py``) and
the flags' help take the types from here, so that a new type is a row of that table and its
decoding beside it, in that one file. The header is read as text, so the table is known without a
compiler.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple

HEADER = Path(__file__).parent / "kernels" / "csrc" / "gguf_blocks.h"
_ROW = re.compile(r"X\((\w+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), __VA_ARGS__\)")


class BlockType(NamedTuple):
    """One row of the table: see gguf_blocks.h for the meaning of each column."""
    id: int           # the type's id in the C kernels
    values: int       # values per block
    bytes: int        # bytes per block
    bias: int         # weight = scale * (q - bias) for the signed types, 0 for scale * q + min
    half_scales: bool  # a scale per half of 16 values of a sub-block of 32
    offsets: int      # offsets (mins) per sub-block of 32


@functools.cache
def block_types() -> dict[str, BlockType]:
    """GGUF type name -> its row, in the table's order."""
    text = HEADER.read_text()
    table = text[text.index("#define GGUF_BLOCK_TYPES"):]
    table = table[:table.index("\n\n")]
    rows = {m[1]: BlockType(int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6] == "1", int(m[7]))
            for m in _ROW.finditer(table)}
    if not rows:
        raise RuntimeError(f"no GGUF_BLOCK_TYPES rows found in {HEADER}")
    return rows


def block_type_names() -> str:
    """The names as a list for messages and help: 'Q4_0, Q4_1, ...'."""
    return ", ".join(sorted(block_types()))
